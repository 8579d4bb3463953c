#!/usr/bin/env python3
"""Time `sglpatch apply --source sdist --no-install` against raw `git am` of the same files.

    python3 scripts/bench_apply.py [--runs 5] [--out results/apply-timing.md]

warm: sdist already in the cache, fresh workdir each run (full build: extract + verify + patches).
noop: re-run on an up-to-date workdir. git am: the same patch files onto a fresh clone of the
upstream branch. cold: an empty cache (pip download of the sdist included), one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd, **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "apply-timing.md"))
    args = ap.parse_args()
    series = [line.split()[0] for line in (ROOT / "series").read_text().splitlines() if line.strip() and not line.startswith("#")]
    patches = [str(ROOT / "patches" / n) for n in series]
    env_git = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull)
    warm, am, noop, rebuild = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        project = tmp / "project"
        project.mkdir()
        for name in ("series", "upstream.lock"):
            shutil.copy2(ROOT / name, project / name)
        shutil.copytree(ROOT / "patches", project / "patches")
        sg = [sys.executable, "-m", "sglpatch.cli", "apply", "--project", str(project), "--source", "sdist", "--no-install"]
        series_text = (project / "series").read_text()
        shorter = series_text.replace(series[-1] + "\n", "")
        subprocess.run(sg + ["--workdir", str(tmp / "seed")], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(args.runs):
            warm.append(timed(sg + ["--workdir", str(tmp / f"w{i}")]))
            noop.append(timed(sg + ["--workdir", str(tmp / f"w{i}")]))
            clone = tmp / f"am{i}"
            subprocess.run(["git", "clone", "-q", "--branch", "upstream", str(tmp / "seed"), str(clone)], check=True, env=env_git)
            am.append(timed(["git", "-c", "user.name=b", "-c", "user.email=b@b", "am", "-q", *patches], cwd=clone, env=env_git))
            # the patch stage alone: the series changed, upstream is reused, patched rebuilt
            (project / "series").write_text(shorter)
            subprocess.run(sg + ["--workdir", str(tmp / f"w{i}")], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            (project / "series").write_text(series_text)
            rebuild.append(timed(sg + ["--workdir", str(tmp / f"w{i}")]))
        cold_env = dict(os.environ, SGLPATCH_CACHE=str(tmp / "cold-cache"))
        cold = timed(sg + ["--workdir", str(tmp / "cold")], env=cold_env)
    mw, ma, mn, mr = statistics.median(warm), statistics.median(am), statistics.median(noop), statistics.median(rebuild)
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    text = f"""# apply timing ({len(series)} patches, SGLang 0.5.9 sdist)

Command: `python3 scripts/bench_apply.py --runs {args.runs}`  
Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {os.cpu_count()} CPU cores, git {subprocess.run(['git', '--version'], capture_output=True, text=True).stdout.split()[-1]}

| what | median s | runs (s) |
|---|---|---|
| `sglpatch apply --source sdist --no-install`, warm cache, fresh workdir | {mw:.2f} | {fmt(warm)} |
| same, re-run on the up-to-date workdir (no-op) | {mn:.2f} | {fmt(noop)} |
| same, series changed: upstream reused, all {len(series)} patches re-applied | {mr:.2f} | {fmt(rebuild)} |
| raw `git am` of the same files on a clone of `upstream` | {ma:.2f} | {fmt(am)} |
| cold: empty cache (pip download of the 4 MB sdist included), one run | {cold:.2f} | |

Ratio warm apply / raw git am: **{mw / ma:.1f}x**; rebuild on an existing workdir / raw git am:
**{mr / ma:.1f}x**. A fresh apply also extracts the 2,100-file sdist into git, verifies the lock and
checks out the whole tree; git am starts from an existing checkout. Every sglpatch row includes
~0.2 s of Python and GitPython start-up (the no-op row).
"""
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
