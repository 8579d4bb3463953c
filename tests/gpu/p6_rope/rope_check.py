#!/usr/bin/env python3
"""P6 (0006) on a GPU: 0.5.9's real rope JIT kernel (jit_kernel/rope.py, patched) built through its own
load_jit against flashinfer 0.7.2's headers with the bundled CCCL, and against flashinfer 0.6.3's
headers (what 0.5.9 pins), run on the same inputs and compared with each other and with a float64
torch reference. Correctness only, never timing; not an SM120 figure on another GPU.

  SGLANG_TREE=... FI072=<dir holding flashinfer/ with data/include and data/cccl> \
  FI063=<dir holding flashinfer/ with data/include> python3 rope_check.py > rope.json

Exit 0 only when both builds succeed and every case is within the bound on both.
"""

import importlib
import json
import os
import sys
import time
import types


def use_flashinfer(root: str):
    """`import flashinfer` as rope.py does, without flashinfer/__init__.py (cutlass-dsl is not here):
    a module whose __file__ is root/flashinfer/__init__.py, so rope.py finds root/flashinfer/data."""
    m = types.ModuleType("flashinfer")
    m.__file__ = os.path.join(root, "flashinfer", "__init__.py")
    m.__path__ = [os.path.join(root, "flashinfer")]
    sys.modules["flashinfer"] = m


def reference(q, k, pos, cache, head, neox):
    import torch

    rot = cache.shape[1]
    cos, sin = cache[pos].double().chunk(2, dim=-1)  # [n, rot/2]

    def one(x):
        x = x.double().view(x.shape[0], -1, head).clone()
        r = x[..., :rot]
        if neox:
            x1, x2 = r[..., : rot // 2], r[..., rot // 2:]
            out = torch.cat([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
            out = torch.stack([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1).flatten(-2)
        x[..., :rot] = out
        return x.view(x.shape[0], -1)

    return one(q), one(k)


def run(label: str, root: str, out: dict) -> dict:
    import torch

    use_flashinfer(root)
    for name in [n for n in sys.modules if n.startswith("sglang.jit_kernel")]:
        del sys.modules[name]
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability()
    t0 = time.time()
    try:
        rope = importlib.import_module("sglang.jit_kernel.rope")
        mod = rope._jit_apply_rope_pos_ids_cos_sin_cache_module()
    except Exception as e:  # the build failing is a result here
        return {"built": False, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
    res = {"built": True, "build_s": round(time.time() - t0, 1), "module": str(type(mod).__name__), "cases": {}}
    g = torch.Generator(device="cuda").manual_seed(1234)
    for head, rot, nq, nk, dtype, neox in [(64, 64, 16, 1, torch.bfloat16, False), (64, 64, 16, 1, torch.bfloat16, True),
                                           (128, 64, 8, 8, torch.bfloat16, False), (128, 128, 32, 8, torch.float16, True),
                                           (256, 128, 4, 4, torch.bfloat16, True)]:
        n, maxpos = 257, 4096
        q = torch.randn(n, nq * head, device="cuda", dtype=dtype, generator=g)
        k = torch.randn(n, nk * head, device="cuda", dtype=dtype, generator=g)
        pos = torch.randint(0, maxpos, (n,), device="cuda", generator=g)
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device="cuda", dtype=torch.float32) / rot))
        f = torch.outer(torch.arange(maxpos, device="cuda", dtype=torch.float32), inv)
        cache = torch.cat([f.cos(), f.sin()], -1).contiguous()
        rq, rk = reference(q, k, pos, cache, head, neox)
        qq, kk = q.clone(), k.clone()
        rope.apply_rope_with_cos_sin_cache_inplace(pos, qq, kk, head, cache, is_neox=neox)
        torch.cuda.synchronize()
        err = max(float((qq.double() - rq).abs().max()), float((kk.double() - rk).abs().max()))
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        bound = 2 * ulp * max(float(rq.abs().max()), float(rk.abs().max()))
        key = f"h{head}-r{rot}-q{nq}k{nk}-{str(dtype)[6:]}-{'neox' if neox else 'interleaved'}"
        res["cases"][key] = {"max_abs_err": err, "bound": bound, "ok": err <= bound}
        out.setdefault("outputs", {}).setdefault(key, {})[label] = (qq.float().cpu(), kk.float().cpu())
    return res


def main() -> int:
    import torch

    sys.path.insert(0, os.path.join(os.environ["SGLANG_TREE"], "python"))
    keep: dict = {}
    report = {"gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "cuda": torch.version.cuda}
    report["fi072_cccl"] = run("fi072", os.environ["FI072"], keep)
    report["fi063"] = run("fi063", os.environ["FI063"], keep)
    same = {}
    for key, sides in keep.get("outputs", {}).items():
        if len(sides) == 2:
            (q1, k1), (q2, k2) = sides["fi072"], sides["fi063"]
            same[key] = bool(torch.equal(q1, q2) and torch.equal(k1, k2))
    report["bitwise_equal_072_vs_063"] = same
    ok = all(report[s].get("built") and all(c["ok"] for c in report[s]["cases"].values()) for s in ("fi072_cccl", "fi063"))
    report["ok"] = bool(ok)  # bitwise equality is reported, not required (flashinfer's kernel source may differ)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
