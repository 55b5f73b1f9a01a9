"""Tune and time the gated GEMM against cuBLAS fc1 (+ our activation), forward only.

    python3 benchmarks/tune_gated_gemm.py [--shapes M,K,F ...] [--samples 30] [--json PATH]

For each shape it prints the autotuner's top configs per variant, then paired medians and
each variant's ratio to the cuBLAS fc1 GEMM alone. This is the measurement behind the
kernel's config list and behind which impls use the fused forward by default.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from swiglu_train.bench.timing import Case, paired_samples
from swiglu_train.files import write_json_atomic
from swiglu_train.kernels import gated_gemm, gated_kernels
from swiglu_train.layers.layout import CANONICAL, Layout, order
from swiglu_train.ops.activation import swiglu_fwd

SEED = [(11136, 3584, 14336)]
QWEN_7B = [(m, 3584, 18944) for m in (1, 16, 128, 512, 2048, 4096)]


def _top_configs(n: int = 4) -> list[str]:
    timings = getattr(gated_kernels._gated_gemm_kernel, "configs_timings", None) or {}
    ranked = sorted(timings.items(), key=lambda kv: kv[1][0] if isinstance(kv[1], list) else kv[1])
    return [f"{t[0] if isinstance(t, list) else t:.4f}ms {c}" for c, t in ranked[:n]]


def variants(m: int, k: int, f: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * f, k, device="cuda") / k**0.5).to(torch.bfloat16)
    chunk = 128 if f % 128 == 0 else f
    packed = w[order(2 * f, CANONICAL, Layout("packed", chunk)).cuda()]
    return {
        "cublas_fc1": lambda: F.linear(x, w),
        "cublas_fc1+act": lambda: swiglu_fwd(F.linear(x, w)),
        "gated_none": lambda: gated_gemm.gated_gemm(x, w, None, chunk=f),
        "gated_preact": lambda: gated_gemm.gated_gemm(x, w, None, chunk=f, aux="preact"),
        "packed_none": lambda: gated_gemm.gated_gemm(x, packed, None, chunk=chunk),
        "packed_factors": lambda: gated_gemm.gated_gemm(
            x, packed, None, chunk=chunk, aux="factors"
        ),
        "_check": (x, w),
    }


def run_shape(m: int, k: int, f: int, samples: int) -> dict:
    fns = variants(m, k, f)
    x, w = fns.pop("_check")
    expected = swiglu_fwd(F.linear(x, w)).float()
    h = gated_gemm.gated_gemm(x, w, None, chunk=f)[0].float()
    err = ((h - expected).norm() / expected.norm()).item()
    configs = {}
    for name, fn in fns.items():
        fn()  # the first call tunes this key
        torch.cuda.synchronize()
        if name.startswith(("gated", "packed")):
            configs[name] = _top_configs()
            print(f"  {name}: " + "\n    ".join(configs[name]), flush=True)
    cases = [Case(n, fn, lambda out: None, lambda: None) for n, fn in fns.items()]
    times = paired_samples(cases, samples, torch.device("cuda"))
    base = times["cublas_fc1"]["fwd"]
    rows = {
        n: {"ms": float(np.median(t["fwd"])), "ratio_to_fc1": float(np.median(t["fwd"] / base))}
        for n, t in times.items()
    }
    print(f"M={m} K={k} F={f} rel_err={err:.2e}")
    for n, r in rows.items():
        print(f"  {n:16s} {r['ms']:.4f} ms  x{r['ratio_to_fc1']:.3f}")
    return {"M": m, "K": k, "F": f, "rel_err": err, "variants": rows, "top_configs": configs}


def _commit() -> str:
    """The COMMIT file the GPU session carries (the box has no .git), else git's HEAD."""
    if os.path.exists("COMMIT"):
        return open("COMMIT").read().strip()
    cmd = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", help="M,K,F triples (default: seed + Qwen-7B)")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes] if args.shapes else SEED + QWEN_7B
    results = [run_shape(*s, args.samples) for s in shapes]
    if args.json:
        commit = _commit()
        out = {"gpu": torch.cuda.get_device_name(), "commit": commit, "shapes": results}
        write_json_atomic(Path(args.json), out)


if __name__ == "__main__":
    main()
