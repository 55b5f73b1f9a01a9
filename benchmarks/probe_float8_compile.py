"""ParMLP on torchao's Float8Linear fc1/fc2 with and without torch.compile, against torchao's
own MLP (``normal`` through Float8Linear) and bf16 drop_h, at [8000, 4096, 14336]: the step's
wall clock over 10 steps after 3 warm-up steps (a probe, not the paired harness), or with
``--memory`` what each holds after forward and at its peak. It showed that FP8 drop_h, like
torchao's MLP, needs torch.compile to fuse its casts (``pretrain --float8`` compiles each block).

    PYTHONPATH=. python benchmarks/probe_float8_compile.py [--memory]
"""

from __future__ import annotations

import argparse
import time

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from swiglu_train.layers.par_mlp import ParMLP

D, F, M = 4096, 14336, 8000
MiB = 2**20
TIMED = [("drop_h", None, False), ("drop_h", "tensorwise", True), ("normal", "tensorwise", True),
         ("drop_h", "rowwise", True), ("normal", "rowwise", True)]  # fmt: skip
MEASURED = [("drop_h", "tensorwise", False), ("drop_h", "tensorwise", True),
            ("normal", "tensorwise", True), ("normal", "tensorwise", False),
            ("drop_h", None, False)]  # fmt: skip


def build(impl: str, recipe: str | None) -> torch.nn.Module:
    mlp = torch.nn.Sequential(ParMLP(D, F, impl=impl, device="cuda", dtype=torch.bfloat16))
    if recipe:
        convert_to_float8_training(mlp, config=Float8LinearConfig.from_recipe_name(recipe))
    return mlp


def step_ms(model, x: torch.Tensor, g: torch.Tensor) -> float:
    for _ in range(3):
        model(x).backward(g)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        model(x).backward(g)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 100


def memory_mib(mlp, model, x: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    for _ in range(2):
        model(x).backward(g)
    for p in mlp.parameters():
        p.grad = None
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = model(x)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated() - base
    y.backward(g)
    torch.cuda.synchronize()
    return after / MiB, (torch.cuda.max_memory_allocated() - base) / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", action="store_true", help="after-forward and peak MiB")
    memory = parser.parse_args().memory
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    for impl, recipe, compiled in MEASURED if memory else TIMED:
        mlp = build(impl, recipe)
        model = torch.compile(mlp) if compiled else mlp
        name = f"{impl} {recipe} compiled={compiled}"
        if memory:
            after, peak = memory_mib(mlp, model, x, g)
            x_mib, preact_mib, h_mib = (M * n * 2 / MiB for n in (D, 2 * F, F))
            sizes = f"(x {x_mib:.0f}, preact {preact_mib:.0f}, h {h_mib:.0f})"
            print(f"{name} after_fwd_MiB {after:.0f} peak_MiB {peak:.0f} {sizes}", flush=True)
        else:
            print(f"{name} ms/step {step_ms(model, x, g):.2f}", flush=True)


if __name__ == "__main__":
    main()
