"""Where a step's host time goes: cProfile's Python functions (tottime) and torch.profiler's
CPU ops for one training step of a routed-experts layer or an FP8 MLP, after warm-up, on the
GPU. A probe, not the paired harness: on a slow host these layers become host-bound (bench-moe's
``host_ms``, bench-grid's), and this says which calls to trim.

    PYTHONPATH=. python benchmarks/profile_host.py CASE [--steps 20] [--out FILE]

CASE: experts:IMPL:MODEL (bench-moe's models, T = 8192, balanced) or fp8:RECIPE[:compile] (a
ParMLP at llama3.2-1b's D, F with M = 8000 on torchao's converted linears).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from swiglu_train.bench.moe.shapes import MODELS
from swiglu_train.layers.experts import ParExperts
from swiglu_train.layers.par_mlp import ParMLP


def experts_step(impl: str, model: str):
    shape = next(m for m in MODELS if m.name == model)
    d, f, e, k, t = shape.d, shape.f, shape.e, shape.k, 8192
    layer = ParExperts(e, d, f, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(t, e, device="cuda")
    weights, indices = torch.softmax(logits, -1).topk(k, -1)
    weights.requires_grad_()
    grad_y = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    return lambda: layer(x, indices, weights).backward(grad_y)


def fp8_step(recipe: str, compiled: bool):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    d, f, m = 2048, 8192, 8000
    mlp = torch.nn.Sequential(ParMLP(d, f, impl="drop_h", device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe_name(recipe))
    run = torch.compile(mlp) if compiled else mlp
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    return lambda: run(x).backward(grad_y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kind, *rest = args.case.split(":")
    step = experts_step(*rest) if kind == "experts" else fp8_step(rest[0], rest[1:] == ["compile"])
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - start) / args.steps * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    report = io.StringIO()
    report.write(f"{args.case}: host {host:.3f} ms/step to queue, wall {wall:.3f} ms/step\n")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile, stream=report)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    report.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    text = report.getvalue()
    print(text[:4000])
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
