"""Each of the MLP step's six GEMMs on cuBLAS and on quack, and save_factors_quack's two
epilogue GEMMs untuned and autotuned, paired: which backend wins which GEMM at the seed shape.

    python scripts/probe_gemm_backends.py --samples 40 --json OUT.json
"""

import argparse
import json
import random
import statistics
import subprocess

import torch
from quack.gemm_interface import gemm, gemm_dgated, gemm_gated

from swiglu_train.ops.quack_save_factors import _epilogues

M, D, F, OUT = 11136, 3584, 14336, 3584


def cases() -> dict[str, dict[str, callable]]:
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    x, h, grad_y = torch.randn(M, D, **bf16), torch.randn(M, F, **bf16), torch.randn(M, OUT, **bf16)
    w1, w2 = torch.randn(2 * F, D, **bf16) / D**0.5, torch.randn(OUT, F, **bf16) / F**0.5
    gp = torch.randn(M, 2 * F, **bf16)
    factors, h_out = torch.randn(M, 2 * F, **bf16), torch.empty(M, F, **bf16)
    epi = _epilogues()
    plain = {  # (A, B) with out = A @ B
        "fc1": (x, w1.t()),
        "fc2": (h, w2.t()),
        "grad_h": (grad_y, w2),
        "grad_W2": (grad_y.t(), h),
        "grad_x": (gp, w1),
        "grad_W1": (gp.t(), x),
    }
    table = {}
    for name, (a, b) in plain.items():
        table[name] = {
            "cublas": lambda a=a, b=b: torch.mm(a, b),
            "quack": lambda a=a, b=b: gemm(a, b, tuned=False),
            "quack_dynamic": lambda a=a, b=b: gemm(a, b, tuned=False, dynamic_scheduler=True),
        }
    out = {"D": factors, "h": h_out}
    table["fc1_epilogue"] = {
        "cublas_fc1_only": lambda: torch.mm(x, w1.t()),
        "quack_gated": lambda: gemm_gated(x, w1.t(), activation="swiglu", tuned=False),
        "factors": lambda: epi.swiglu_factors_epilogue(x, w1.t(), out=out, tuned=False),
        "factors_tuned": lambda: epi.swiglu_factors_epilogue(x, w1.t(), out=out, tuned=True),
    }
    grad = {"D": torch.empty_like(factors)}
    table["grad_h_epilogue"] = {
        "cublas_grad_h_only": lambda: torch.mm(grad_y, w2),
        "quack_dgated": lambda: gemm_dgated(
            grad_y, w2, factors, activation="swiglu", tuned=False, dynamic_scheduler=True
        ),
        "factors": lambda: epi.factors_to_grad_epilogue(
            grad_y, w2, factors, out=grad, tuned=False, dynamic_scheduler=True
        ),
        "factors_static": lambda: epi.factors_to_grad_epilogue(
            grad_y, w2, factors, out=grad, tuned=False
        ),
        "factors_tuned": lambda: epi.factors_to_grad_epilogue(
            grad_y, w2, factors, out=grad, tuned=True, dynamic_scheduler=True
        ),
    }
    return table


def time_group(fns: dict, samples: int, reps: int) -> dict[str, dict[str, float]]:
    """Median ms per backend, and the median per-sample ratio to the group's first backend."""
    for fn in fns.values():  # compile, autotune, warm up
        fn(), fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(samples):
        for name in random.sample(list(fns), len(fns)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fns[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    first = next(iter(fns))
    base = times[first]
    return {
        name: {
            "median_ms": statistics.median(t),
            "ratio_to_" + first: statistics.median(a / b for a, b in zip(t, base, strict=True)),
        }
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    results = {}
    for group, fns in cases().items():
        results[group] = time_group(fns, args.samples, args.reps)
        for name, r in results[group].items():
            ratio = list(r.values())[1]
            print(f"{group:16s} {name:20s} {r['median_ms']:.3f} ms  {ratio:.3f}")
    commit = subprocess.run(["cat", "COMMIT"], capture_output=True, text=True).stdout.strip()
    meta = {"shape": [M, D, F, OUT], "dtype": "bf16", "samples": args.samples, "reps": args.reps}
    meta |= {"device_name": torch.cuda.get_device_name(), "commit": commit}
    meta["command"] = f"python scripts/probe_gemm_backends.py --samples {args.samples} --json OUT"
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
