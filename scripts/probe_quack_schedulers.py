"""quack's static against its dynamic persistent scheduler on each backward GEMM of the quack
impls, and cuBLAS beside them, at MLP training shapes (untuned configs, as the impls run).

Each GEMM is timed in paired samples (both schedulers and cuBLAS in a random order per
sample, CUDA events, median of --samples), on data far past L2. Each sample starts on an idle
GPU, so launch latency counts: scripts/probe_gemm_defaults.py times the same choice queued,
as a training step runs its GEMMs, and supersedes this probe's verdict.

    python scripts/probe_quack_schedulers.py --json OUT.json [--shapes M,D,F ...]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from swiglu_train.bench.mlp import write_probe_result
from swiglu_train.ops.quack_mlp import require_quack

SHAPES = ("11136,3584,14336", "8192,4096,14336", "8000,4096,11008", "4096,2048,8192",
          "16384,5120,13824", "8192,8192,28672")  # fmt: skip


def gemms(m: int, d: int, f: int) -> dict:
    """name -> {backend: callable} for each backward GEMM of drop_h_quack, and
    save_factors_quack's grad_x (fc1 packed: no concat_layout)."""
    q = require_quack()
    dt, dev = torch.bfloat16, "cuda"
    x = torch.randn(m, d, dtype=dt, device=dev)
    w1 = torch.randn(2 * f, d, dtype=dt, device=dev) / d**0.5
    w2 = torch.randn(d, f, dtype=dt, device=dev) / f**0.5
    grad_y = torch.randn(m, d, dtype=dt, device=dev)
    preact = torch.randn(m, 2 * f, dtype=dt, device=dev)
    h = torch.randn(m, f, dtype=dt, device=dev)
    gp = torch.randn(m, 2 * f, dtype=dt, device=dev)

    def q_gemm(dyn, *a, **k):
        return lambda: q.gemm(*a, tuned=False, dynamic_scheduler=dyn, **k)

    def dgated(dyn):
        return lambda: q.gemm_dgated(
            grad_y, w2, preact, activation="swiglu", tuned=False, dynamic_scheduler=dyn
        )

    return {
        "fc2": {
            "static": q_gemm(False, h, w2.t()),
            "dynamic": q_gemm(True, h, w2.t()),
            "cublas": lambda: h @ w2.t(),
        },
        "grad_h": {"static": dgated(False), "dynamic": dgated(True), "cublas": lambda: grad_y @ w2},
        "grad_w2": {
            "static": q_gemm(False, grad_y.t(), h),
            "dynamic": q_gemm(True, grad_y.t(), h),
            "cublas": lambda: grad_y.t() @ h,
        },
        "grad_x": {
            "static": q_gemm(False, gp, w1, concat_layout=("B",)),
            "dynamic": q_gemm(True, gp, w1, concat_layout=("B",)),
            "cublas": lambda: gp @ w1,
        },
        "grad_x_packed": {  # save_factors_quack's: grad_preact and fc1 both packed, chunk 1
            "static": q_gemm(False, gp, w1),
            "dynamic": q_gemm(True, gp, w1),
            "cublas": lambda: gp @ w1,
        },
        "grad_w1": {
            "static": q_gemm(False, gp.t(), x, concat_layout=("out",)),
            "dynamic": q_gemm(True, gp.t(), x, concat_layout=("out",)),
            "cublas": lambda: gp.t() @ x,
        },
    }


def time_paired(fns: dict, samples: int, rng) -> dict:
    names = list(fns)
    for fn in fns.values():
        for _ in range(3):
            fn()
    times = {n: [] for n in names}
    for _ in range(samples):
        for i in rng.permutation(len(names)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fns[names[i]]()
            e.record()
            e.synchronize()
            times[names[i]].append(s.elapsed_time(e))
    return {n: np.array(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--commit")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for spec in args.shapes:
        m, d, f = (int(v) for v in spec.split(","))
        for name, fns in gemms(m, d, f).items():
            t = time_paired(fns, args.samples, rng)
            row = {"M": m, "D": d, "F": f, "gemm": name, "sms": sms}
            row |= {f"{b}_ms": float(np.median(v)) for b, v in t.items()}
            row["dynamic_over_static"] = float(np.median(t["dynamic"] / t["static"]))
            row["static_over_cublas"] = float(np.median(t["static"] / t["cublas"]))
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
        torch.cuda.empty_cache()
    write_probe_result("scripts/probe_quack_schedulers.py", rows, args.samples, args.commit,
                       args.json)  # fmt: skip


if __name__ == "__main__":
    main()
