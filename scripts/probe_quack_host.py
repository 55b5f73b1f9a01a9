"""Where the quack impls spend host time per step (issue 18): each GEMM call alone, and cProfile.

At M = 2048 the grid (benchmarks/results/grid/grid_m2048_h200.md) found `drop_h_quack` host-bound
up to D = 4096 (queuing a step took ~2.4 ms against `save_factors_quack`'s ~1.7), although both
make six GEMM calls on quack or cuBLAS. This probe queues each call 200 times behind a spin
kernel long enough that the GPU never waits on the host, and reports the host's microseconds
per call; then the top self-time functions of whole ParMLP steps under cProfile.

    python scripts/probe_quack_host.py --shape 2048,4096,11008 --out $OUT/probe_quack_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from swiglu_train.bench.mlp import environment
from swiglu_train.files import write_json_atomic
from swiglu_train.layers import ParMLP
from swiglu_train.ops import quack_mlp, quack_save_factors


def host_us(fn, reps: int) -> float:
    """Mean µs the host takes per call, queued behind a spin so that it never waits on the GPU."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spin: the queue never drains while we time
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    us = (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    return us


def calls(m: int, d: int, f: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(m, d, device=dev, dtype=dt)
    w1 = torch.randn(2 * f, d, device=dev, dtype=dt) / d**0.5
    w2 = torch.randn(d, f, device=dev, dtype=dt) / f**0.5
    gy = torch.randn(m, d, device=dev, dtype=dt)
    q = quack_mlp.require_quack()
    preact, h = q.gemm_gated(
        x, w1.t(), activation="swiglu", tuned=False, concat_layout=("B", "bias")
    )
    factors = torch.randn(m, 2 * f, device=dev, dtype=dt)
    return {
        "cublas_mm_fc1": lambda: x @ w1.t(),
        "quack_gemm_gated_concat": lambda: q.gemm_gated(
            x, w1.t(), activation="swiglu", tuned=False, concat_layout=("B", "bias")
        ),
        "quack_gemm_dgated": lambda: q.gemm_dgated(
            gy, w2, preact, activation="swiglu", tuned=False, dynamic_scheduler=False
        ),
        # w1 read as packed (chunk 1): other values, the same host path
        "ours_factors_epilogue": lambda: quack_save_factors.quack_swiglu_factors(
            x, w1, None, False
        ),
        "ours_factors_to_grad": lambda: quack_save_factors.quack_factors_to_grad(
            gy, w2, factors, False
        ),
        "quack_gemm_static": lambda: q.gemm(gy.t(), h, tuned=False, dynamic_scheduler=False),
        "quack_gemm_dynamic": lambda: q.gemm(gy.t(), h, tuned=False, dynamic_scheduler=True),
        "chosen_grad_x_concat": lambda: quack_mlp.chosen_gemm("grad_x_concat", preact, w1),
        "chosen_grad_w1_concat": lambda: quack_mlp.chosen_gemm("grad_w1_concat", preact.t(), x),
        "chosen_fc2": lambda: quack_mlp.chosen_gemm("fc2", h, w2.t()),
    }


def steps(m: int, d: int, f: int) -> dict:
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    out = {}
    for impl in ("drop_h", "save_factors_quack", "drop_h_quack"):
        layer = ParMLP(d, f, d, impl=impl, device="cuda", dtype=torch.bfloat16)

        def step(layer=layer) -> None:
            layer(x).backward(gy)

        out[impl] = step
    return out


def profile(step, reps: int, top: int = 25) -> list[dict]:
    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{file.split('site-packages/')[-1]}:{line}({name})",
                "calls_per_step": ncalls / reps,
                "self_us": tottime / reps * 1e6,
                "cum_us": cumtime / reps * 1e6,
            }
        )
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2048,4096,11008")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    m, d, f = (int(v) for v in args.shape.split(","))
    per_call = {name: host_us(fn, args.reps) for name, fn in calls(m, d, f).items()}
    step_fns = steps(m, d, f)
    per_step = {name: host_us(fn, args.reps // 4) for name, fn in step_fns.items()}
    profiles = {name: profile(fn, args.reps // 4) for name, fn in step_fns.items()}
    result = {
        "command": "python " + " ".join(sys.argv),
        **environment(torch.device("cuda"), None),
        "shape": [m, d, f],
        "host_us_per_call": per_call,
        "host_us_per_step": per_step,
        "cprofile_top_self": profiles,
    }
    write_json_atomic(args.out, result)
    for name, us in {**per_call, **per_step}.items():
        print(f"{name:28s} {us:8.1f} us")
    for name, rows in profiles.items():
        print(name)
        for r in rows[:14]:
            print(
                f"  {r['self_us']:7.1f} self {r['cum_us']:8.1f} cum x{r['calls_per_step']:.0f}"
                f"  {r['function'][-90:]}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
