"""Latency-vs-size plot for the kernel tier (matplotlib optional)."""

from __future__ import annotations


def plot_kernel(kernel: dict, out_png: str) -> str | None:
    """Draw median latency vs message size per backend, one panel per mode.

    Returns None when the PNG was written, else a one-line note saying why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"plot skipped: matplotlib not importable ({type(e).__name__}); pip install 'sglpatch[plot]'"
    rows = [r for r in kernel.get("results", []) if r.get("status") == "ok"]
    if not rows:
        return "plot skipped: no successful measurements"
    modes = [m for m in ("eager", "graph") if any(r["mode"] == m for r in rows)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.8), squeeze=False)
    hw = kernel.get("hardware") or {}
    multi = len({r.get("install", "A") for r in rows}) > 1
    for ax, mode in zip(axes[0], modes):
        for backend, inst in sorted({(r["backend"], r.get("install", "A")) for r in rows if r["mode"] == mode}):
            pts = sorted((r["bytes"], r["median_us"], r["p90_us"]) for r in rows
                         if r["mode"] == mode and r["backend"] == backend and r.get("install", "A") == inst)
            xs = [p[0] / 1024 for p in pts]
            ax.plot(xs, [p[1] for p in pts], marker="o", label=f"{backend} [{inst}]" if multi else backend)
            ax.fill_between(xs, [p[1] for p in pts], [p[2] for p in pts], alpha=0.15)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (KiB, rows x hidden bf16)")
        ax.set_ylabel("allreduce latency, median (band to p90), us")
        ax.set_title(f"{mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.axvline(3 * kernel.get("hidden", 7168) * 2 / 1024, color="grey", ls=":", lw=1)
        ax.legend(fontsize=8)
    fig.suptitle(f"{hw.get('world_size', '?')}x {hw.get('gpu_name', '?')} "
                 f"(NVLink: {hw.get('nvlink')}), torch {hw.get('torch', '?')}, NCCL {hw.get('nccl', '?')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return None
