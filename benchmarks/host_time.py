"""Host time of one ParMLP forward+backward, on CPU (issue 18): the Python a step costs.

At small shapes (D <= 2048) an H200 finishes a layer's kernels before the host has queued them,
so the host's time is the step time (benchmarks/results/host/probe_step_gap_h200.json, ``host_ms``).
This probe times that Python on CPU, at a tiny shape (default M=8, D=F=O=16, fp32) where the
arithmetic is negligible, with one intra-op thread.

What runs on CPU. Without ``TRITON_INTERPRET=1`` Triton cannot run here, so every ParMLP impl
takes the same Python path as on CUDA (the module's checks, the dispatch, the autograd Function,
the in-place bookkeeping) down to ``ops.activation``, where ``triton_enabled`` sends the
activation to its plain-torch twin (``ops.reference``: 4-8 small torch ops, plus two ``copy_``
for drop_h's in-place backward) instead of the kernel wrapper and Triton's launcher. So the
Triton launch path (``kernels.swiglu``: its checks, tile rule and ``kernel[grid]``) is not in
these times; the launch rule alone (tile and grid) is timed in ``launch_rule``. The quack
impls refuse CPU tensors (``check_quack_inputs``) and are not timed: their Python before
quack's own is read in the code.

Variants, paired (each sample times one step of every variant, in a fresh random order), grads
reset outside the timed region, medians over samples:
  eager         plain torch: F.linear, F.silu(gate) * up, F.linear, differentiated by autograd;
  minimal       a bare autograd.Function with drop_h's torch ops on CPU and no checks (h
                recomputed, grad_preact and h copied over the saved preact and grad_h): the
                floor for drop_h's design, so ``drop_h - minimal`` is our Python overhead;
  op:drop_h, op:normal   ``ops.drop_h_mlp`` / ``ops.normal_mlp`` called directly (no module);
  normal, drop_h, drop_h:out_of_place, save_factors   ``ParMLP(impl=...)`` on x [M, D];
  drop_h:3d     ``ParMLP(impl="drop_h")`` on x [2, M/2, D], as a model calls it;
  normal:hooked, drop_h:hooked   under identity saved-tensor hooks, as inside a checkpoint:
                drop_h's fc2 is then a node of its own (``ops.fc2_node``), normal's the same.
Then cProfile of ParMLP steps: the top self-time functions of swiglu_train, medians over ten
runs (cProfile's own per-call cost inflates every figure, and self time includes the torch
operators a function calls through Python's operators, ``a @ b``: read the ranking).

Each run is stored under ``--label`` in the JSON (other labels kept), with the command and
commit, so one file holds the before and after of a change, measured by the same command. The
"before" code is an exported tree run by this script (outside the checkout, so that the
exported package is the one imported):

    git archive BEFORE swiglu_train | tar -x -C /tmp/before
    cd /tmp && PYTHONPATH=/tmp/before python /path/to/benchmarks/host_time.py \
        --label before --commit BEFORE --out /path/to/benchmarks/results/host/host_time_cpu.json
    python benchmarks/host_time.py --label after --out benchmarks/results/host/host_time_cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import triton

import swiglu_train
from swiglu_train.files import write_json_atomic
from swiglu_train.kernels import swiglu as swiglu_kernels
from swiglu_train.kernels.runtime import INTERPRET
from swiglu_train.layers import ParMLP
from swiglu_train.ops import drop_h_mlp, normal_mlp, reference

PROFILED = ("normal", "drop_h", "save_factors")
PACKAGE = Path(swiglu_train.__file__).parent


class _MinimalDropH(torch.autograd.Function):
    """drop_h's math and saved tensors on the torch ops ParMLP runs on CPU, with no checks."""

    @staticmethod
    def forward(ctx, x, w1, w2):
        preact = F.linear(x, w1)
        ctx.save_for_backward(x, w1, w2, preact)
        return F.linear(reference.swiglu(preact), w2)

    @staticmethod
    def backward(ctx, grad_y):
        x, w1, w2, preact = ctx.saved_tensors
        grad_h = grad_y @ w2
        h, grad_preact = reference.swiglu(preact), reference.swiglu_grad(preact, grad_h)
        preact.copy_(grad_preact)
        grad_h.copy_(h)
        return preact @ w1, preact.t() @ x, grad_y.t() @ grad_h


def variants(m: int, d: int, f: int) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """Each variant as a step (forward + backward) on shared inputs, and the grad reset."""
    torch.manual_seed(0)
    x = torch.randn(m, d, requires_grad=True)
    x3 = torch.randn(2, m // 2, d, requires_grad=True)  # [batch, sequence, D], as models call
    grad_y = torch.randn(m, d)
    grad_y3 = grad_y.view(2, m // 2, d)
    w1 = torch.nn.Parameter(torch.randn(2 * f, d) / d**0.5)
    w2 = torch.nn.Parameter(torch.randn(d, f) / f**0.5)
    params = [x, x3, w1, w2]
    mlps = {
        "normal": ParMLP(d, f, impl="normal"),
        "drop_h": ParMLP(d, f, impl="drop_h"),
        "drop_h:out_of_place": ParMLP(d, f, impl="drop_h", inplace=False),
        "save_factors": ParMLP(d, f, impl="save_factors"),
    }
    for mlp in mlps.values():
        params += list(mlp.parameters())

    def gate_up(x):
        gate, up = torch.chunk(F.linear(x, w1), 2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    forwards: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager": gate_up,
        "minimal": lambda x: _MinimalDropH.apply(x, w1, w2),
        "op:drop_h": lambda x: drop_h_mlp(x, w1, None, w2, None),
        "op:normal": lambda x: normal_mlp(x, w1, None, w2, None),
        **mlps,
    }

    def step(forward):
        return lambda: forward(x).backward(grad_y)

    def step3(forward):
        return lambda: forward(x3).backward(grad_y3)

    def hooked(forward):  # saved-tensor hooks on, as a checkpoint's: drop_h's fc2 a node apart
        def run() -> None:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                y = forward(x)
            y.backward(grad_y)

        return run

    def reset() -> None:
        for p in params:
            p.grad = None

    steps = {name: step(fwd) for name, fwd in forwards.items()}
    steps["drop_h:3d"] = step3(mlps["drop_h"])
    steps["normal:hooked"] = hooked(mlps["normal"])
    steps["drop_h:hooked"] = hooked(mlps["drop_h"])
    return steps, reset


def paired_us(steps: dict[str, Callable[[], None]], reset, samples: int, seed: int) -> dict:
    """Median µs per step of each variant (and its 25th/75th percentiles)."""
    names = list(steps)
    for name in names:  # warm-up: first-call caches, allocator
        for _ in range(50):
            reset()
            steps[name]()
    times = {name: np.empty(samples) for name in names}
    rng = np.random.default_rng(seed)
    for s in range(samples):
        for i in rng.permutation(len(names)):
            reset()
            t0 = time.perf_counter()
            steps[names[i]]()
            times[names[i]][s] = (time.perf_counter() - t0) * 1e6
    return {
        name: {
            "median_us": round(float(np.median(t)), 2),
            "p25_us": round(float(np.percentile(t, 25)), 2),
            "p75_us": round(float(np.percentile(t, 75)), 2),
        }
        for name, t in times.items()
    }


def profile(step: Callable[[], None], reset, steps: int, top: int, chunks: int = 10) -> dict:
    """cProfile of ``steps`` steps in ``chunks`` runs: swiglu_train's functions by self time,
    µs per step, each the median over the runs (a run the OS preempted would otherwise charge
    its pause to whichever function it hit)."""
    per_chunk = steps // chunks
    totals, ours = [], {}
    for c in range(chunks):
        prof = cProfile.Profile()
        gc.disable()  # a collection's pause would be charged to whichever call triggered it
        prof.enable()
        for _ in range(per_chunk):
            reset()
            step()
        prof.disable()
        gc.enable()
        stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, ..)
        totals.append(sum(row[2] for row in stats.values()) / per_chunk * 1e6)
        for (file, line, name), row in stats.items():
            if "/swiglu_train/" in file:
                where = f"{Path(file).relative_to(Path(file).parents[2])}:{line}({name})"
                ours.setdefault(where, (row[1] / per_chunk, [0.0] * chunks))[1][c] = (
                    row[2] / per_chunk * 1e6
                )
    medians = {fn: (calls, float(np.median(t))) for fn, (calls, t) in ours.items()}
    ranked = sorted(medians.items(), key=lambda kv: -kv[1][1])
    return {
        "profiled_us_per_step": round(float(np.median(totals)), 2),
        "swiglu_train_self_us_per_step": round(sum(t for _, t in medians.values()), 2),
        "top_self": [
            {"function": fn, "calls_per_step": calls, "self_us": round(t, 2)}
            for fn, (calls, t) in ranked[:top]
        ],
    }


def launch_rule_us(m: int, f: int, calls: int = 20000) -> dict:
    """µs per call of what ``kernels.swiglu._launch`` computes before ``kernel[grid]`` (the tile
    and the grid), as on CUDA (not the interpreter's tile): ``launch_config`` where the module
    has it, else, as ``_launch`` ran before it, ``tile`` and two ``triton.cdiv``."""
    rule = swiglu_kernels.BWD_TILE
    config = getattr(swiglu_kernels, "launch_config", None)
    if config is not None:
        how = "launch_config(M, F, rule, interpret=False)"

        def call() -> None:
            config(m, f, rule, interpret=False)

    else:
        how = "tile(M, F, rule, interpret=False) + 2 triton.cdiv"

        def call() -> None:
            block_m, block_n, _ = swiglu_kernels.tile(m, f, rule, interpret=False)
            (triton.cdiv(m, block_m) * triton.cdiv(f, block_n),)

    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return {"us": round((time.perf_counter() - t0) / calls * 1e6, 3), "timed": how}


def git(*args: str) -> str | None:
    """git's answer about the swiglu_train imported here (None outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def changed_files() -> list[str]:
    """swiglu_train's files changed since its commit (another helper's work in progress)."""
    return [line for line in (git("status", "--porcelain", ".") or "").splitlines() if line]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the run's key in the JSON (before, after)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--d", type=int, default=16, help="D = O")
    parser.add_argument("--f", type=int, default=16)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--profile-steps", type=int, default=3000)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--commit", help="the commit of an exported swiglu_train (default: its checkout's HEAD)"
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if INTERPRET:
        parser.error("unset TRITON_INTERPRET: the interpreter would time Triton, not our Python")
    torch.set_num_threads(1)
    steps, reset = variants(args.m, args.d, args.f)
    run = {
        "command": "python benchmarks/host_time.py " + shlex.join(argv),
        "commit": args.commit or git("rev-parse", "HEAD"),
        "swiglu_train": str(PACKAGE),
        "uncommitted": None if args.commit else changed_files(),
        "torch": torch.__version__,
        "shape": {"M": args.m, "D": args.d, "F": args.f, "O": args.d, "dtype": "float32"},
        "samples": args.samples,
        "step_us": paired_us(steps, reset, args.samples, args.seed),
        "launch_rule": launch_rule_us(args.m, args.f),
        "profile": {
            impl: profile(steps[impl], reset, args.profile_steps, args.top) for impl in PROFILED
        },
    }
    floor = run["step_us"]["minimal"]["median_us"]
    run["over_minimal_us"] = {
        name: round(v["median_us"] - floor, 2) for name, v in run["step_us"].items()
    }
    path = Path(args.out)
    result = json.loads(path.read_text()) if path.is_file() else {}
    result.setdefault("what", __doc__.splitlines()[0])
    result.setdefault("runs", {})[args.label] = run
    write_json_atomic(path, result)
    for name, v in run["step_us"].items():
        print(f"{name:22s} {v['median_us']:8.1f} us  (+{run['over_minimal_us'][name]:.1f})")
    return result


if __name__ == "__main__":
    main()
