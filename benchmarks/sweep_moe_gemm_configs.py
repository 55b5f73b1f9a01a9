"""quack configs for drop_h_quack's six varlen GEMMs at MoE expert shapes, each timed paired
against quack's untuned default (what ``ops.experts_quack`` ships) and against its
``torch._grouped_mm`` twin (the MoE bench's floor): the measurement a config rule (wave fill
over the SMs, tile fit to N and to the rows per expert) is to be fitted from.

    python benchmarks/sweep_moe_gemm_configs.py [--models A,B] [--routing balanced,skewed]
        [--gemms fc1,grad_W1] [--configs 128x128-pp-2x1-static,...] [--max-configs 12]
        [--samples 30] --json OUT.json [--md OUT.md]

This file times; its siblings say what: ``moe_gemm_candidates.py`` (the configs quack can run
per GEMM, the operands, the calls) and ``moe_gemm_report.py`` (the JSON rows and the markdown).
Each candidate's output is checked against the default's before it is timed; one that fails to
compile or run, or differs, is recorded with its reason.

Every call of a sample runs in a fresh random order (``timing.paired_samples``) behind a short
spin hold and after a read of twice the L2, so each starts from a cold cache, as the expert
weights do in training; ratios are medians of per-sample ratios. quack keys a kernel by dtypes,
majors, flags and config, never by size, so ``precompile`` first compiles every (GEMM, config)
at once in quack's compile pool, on a tiny point, as quack's autotuner compiles its candidates.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from moe_gemm_candidates import (
    CONFIGS,
    GEMMS,
    Config,
    GemmOperands,
    Point,
    candidates,
    make_point,
    operands,
    rel_err,
    run_config,
    run_twin,
    shipped,
    unsupported,
)
from moe_gemm_report import kind_table, progress, rows_of, summarize, to_markdown

from swiglu_train.bench.moe.routing import ROUTINGS
from swiglu_train.bench.moe.shapes import MoEShape, select_models
from swiglu_train.bench.results import environment, write_result
from swiglu_train.bench.timing import Case, paired_samples
from swiglu_train.ops.quack_mlp import require_quack

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite",
          "qwen1.5-moe-a2.7b", "deepseek-v3")  # fmt: skip
HOLD_MS = 1.0  # one GEMM queues in well under this; the clock lengthens it if not
CONFIG_LIMIT = 1e-3  # a candidate against the default: rounding at most (fp32 sums, bf16 out)
TWIN_LIMIT = 1e-2  # the default against torch: the same GEMM, other summation orders
PRECOMPILE_S = 180.0  # a pool slower than this leaves the rest to the sweep, in-process
TINY = MoEShape("tiny", "", 128, 128, 4, 2)  # precompile's point: kernels do not depend on size


def _reason(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def measure(
    op: GemmOperands, configs: Sequence[Config], samples: int, seed: int, flush: Callable
) -> tuple[dict[str, np.ndarray], dict[str, float], dict[str, str]]:
    """Per call (torch, default, each candidate that checks out) its times; each one's rel err
    against the default; and why each failed candidate failed."""
    default = shipped(op)
    errors = {"torch": rel_err(run_twin(op), default), "default": 0.0}
    if not errors["torch"] <= TWIN_LIMIT:
        raise AssertionError(f"{op.name}: quack's default and torch._grouped_mm differ by "
                             f"{errors['torch']:.2e}: the operands are not one GEMM")  # fmt: skip
    calls = {"torch": functools.partial(run_twin, op), "default": functools.partial(shipped, op)}
    failed = {}
    for c in configs:
        try:
            config = c.quack()
            op.out.fill_(math.nan)
            errors[c.label] = rel_err(run_config(op, config), default)
        except Exception as e:  # a compile error, a launch refused: recorded, not fatal
            failed[c.label] = _reason(e)
            continue
        if errors[c.label] <= CONFIG_LIMIT:
            calls[c.label] = functools.partial(run_config, op, config)
        else:
            failed[c.label] = f"output differs from the default's: rel err {errors[c.label]:.2e}"
    del default
    for call in calls.values():
        call()  # warm: launch plans, cuBLAS's heuristics
    cases = [Case(name, call, lambda _: None, flush) for name, call in calls.items()]
    times = paired_samples(cases, samples, op.a.device, seed, hold_ms=HOLD_MS)
    return {name: t["fwd"] for name, t in times.items()}, errors, failed


def sweep_gemm(
    p: Point, gemm: str, configs: Sequence[Config], default: Config, samples: int, seed: int,
    flush: Callable,
) -> list[dict]:  # fmt: skip
    op = operands(p, gemm)
    times, errors, failed = measure(op, configs, samples, seed, flush)
    return rows_of(p, op, times, errors, failed, default)


def precompile(
    gemms: Sequence[str], configs: dict[str, list[Config]], seed: int, device: torch.device
) -> str:
    """Compile every kernel the sweep runs at once, in quack's compile pool (``quack.cache``'s
    ``pool_scope``, as quack's autotuner does): a cold kernel raises ``CompilePending`` while a
    worker compiles it into the disk cache, and is retried once it lands. Failures are left to
    the sweep, which compiles them in-process and records why."""
    from quack.cache import CompilePending, pool_scope

    p = make_point(TINY, "balanced", 64, seed, device)
    calls = []
    for gemm in gemms:
        op = operands(p, gemm)
        calls.append(functools.partial(shipped, op))
        calls += [functools.partial(run_config, op, c.quack()) for c in configs[gemm]]
    start, queue, failed, waited = time.monotonic(), deque(calls), 0, 0
    with pool_scope():
        while queue and time.monotonic() - start < PRECOMPILE_S:
            call = queue.popleft()
            try:
                call()
                waited = 0
            except CompilePending:
                queue.append(call)
                waited += 1
                if waited >= len(queue):  # a whole round pending: let the workers work
                    time.sleep(0.1)
                    waited = 0
            except Exception:
                failed += 1
    torch.cuda.synchronize()
    return (f"precompile: {len(calls)} kernels in {time.monotonic() - start:.0f} s, {failed} "
            f"failed, {len(queue)} left to compile in-process")  # fmt: skip


def _names(value: str, known: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"{what}: unknown {unknown or 'none given'}; choose from {list(known)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="bench-moe's model names")
    parser.add_argument("--routing", default=",".join(ROUTINGS))
    parser.add_argument("--gemms", default=",".join(GEMMS))
    parser.add_argument("--configs", default=",".join(CONFIGS), help="candidate labels, in order")
    parser.add_argument("--max-configs", type=int, default=12, help="candidates per GEMM")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--commit")
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    args = parser.parse_args()
    try:
        models = select_models([n.strip() for n in args.models.split(",") if n.strip()])
        routings = _names(args.routing, ROUTINGS, "--routing")
        gemms = _names(args.gemms, GEMMS, "--gemms")
        configs = [Config.parse(c) for c in args.configs.split(",") if c.strip()]
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("error: the candidates are quack's SM90 configs: this needs a Hopper GPU")
    require_quack()  # one line where quack is missing
    from quack.gemm_config import default_config

    device = torch.device("cuda")
    default = Config.of(default_config(device))
    chosen = {g: candidates(g, configs, default, args.max_configs) for g in gemms}
    props = torch.cuda.get_device_properties(device)
    cache = torch.zeros(2 * props.L2_cache_size, dtype=torch.int8, device=device)
    flush = functools.partial(torch.sum, cache)  # a read: leaves the L2 clean, not dirty
    if args.precompile:
        try:
            print(precompile(gemms, chosen, args.seed, device), flush=True)
        except Exception as e:  # the pool itself: the sweep compiles each kernel in-process
            print(f"precompile: {_reason(e)}; compiling in-process", flush=True)
    env = environment(device, args.commit)
    result = {
        "gpu": env["device_name"], "sm_count": props.multi_processor_count,
        "commit": env["commit"], "environment": env, "tokens": args.tokens,
        "samples": args.samples, "default": default.label,
        "configs": {g: [c.label for c in cs] for g, cs in chosen.items()},
        "skipped": {g: {c.label: unsupported(c, g) for c in configs if unsupported(c, g)}
                    for g in gemms},
        "errors": [], "rows": [],
    }  # fmt: skip
    for shape in models:
        for routing in routings:
            p = make_point(shape, routing, args.tokens, args.seed, device)
            for gemm in gemms:
                try:
                    rows = sweep_gemm(p, gemm, chosen[gemm], default, args.samples, args.seed,
                                      flush)  # fmt: skip
                except Exception as e:  # out of memory, operands that disagree: this GEMM's loss
                    result["errors"].append({"model": shape.name, "routing": routing,
                                             "gemm": gemm, "error": _reason(e)})  # fmt: skip
                    rows = []
                torch.cuda.empty_cache()
                result["rows"] += rows
                print(progress(shape.name, routing, gemm, rows, result["errors"]), flush=True)
            del p
            torch.cuda.empty_cache()
            write_result(f"benchmarks/{Path(__file__).name}", result, args.json, args.md,
                         to_markdown)  # fmt: skip
    print("\n".join(kind_table(summarize(result["rows"]))))


if __name__ == "__main__":
    main()
