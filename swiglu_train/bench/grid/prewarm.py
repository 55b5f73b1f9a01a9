"""The model grid's pre-warm task (the pool is ``bench/prewarm.py``): a point's variants built
and run untimed in a worker process before the timing pass.

One timing process paid 46-108 s of compiling at the first M of each new (D, F)
(``benchmarks/results/grid/grid_h200.json``), and 6-12 s at the next M: a (D, F) compiles once
per dtype and variant, whatever its M, so it is the pool's shape.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence

import torch

from swiglu_train.bench.mlp.run import BenchConfig, available_cases, layer_inputs
from swiglu_train.bench.prewarm import Job, Warmed, worker_outcome
from swiglu_train.bench.timing import Clock, run_once

log = logging.getLogger(__name__)


def label(cfg: BenchConfig) -> str:
    m, d, f, _ = cfg.shape
    return f"M={m} D={d} F={f}"


def grid_jobs(configs: Sequence[BenchConfig]) -> list[Job]:
    """The pool's jobs: one per point, its (D, F) the shape that compiles, larger first."""
    return [Job(c, label(c), (c.shape[1], c.shape[2]), c.shape[1] * c.shape[2]) for c in configs]


def release(device: torch.device) -> None:
    """Free a point's weights and compiled graphs before the next shape: each point compiles
    its own static shape (dynamo would otherwise recompile the same code with dynamic sizes,
    and fall back to eager past its recompile limit) from an empty allocator cache."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_point(cfg: BenchConfig) -> Warmed:
    """In a worker: build every variant at ``cfg.shape`` and run ``cfg.warmup`` untimed
    forward+backward steps of each (``measure_layer``'s warm-up), then free the GPU memory."""
    began = time.perf_counter()
    device = torch.device(cfg.device)
    m, d, f, _ = cfg.shape
    try:
        warmed, not_warmed = _warm_variants(cfg, device)
    except Exception as e:  # the inputs or a builder: the timing pass meets it again
        warmed, not_warmed = [], {"all": f"{type(e).__name__}: {e}".splitlines()[0]}
        log.warning("pre-warm M=%d D=%d F=%d failed: %s", m, d, f, not_warmed["all"])
    release(device)
    return worker_outcome(label(cfg), began, warmed, not_warmed, device)


def _warm_variants(cfg: BenchConfig, device: torch.device) -> tuple[list[str], dict[str, str]]:
    weights, x, grad_y = layer_inputs(cfg, 1)
    cases, not_warmed = available_cases(cfg.variants, weights, x, grad_y)
    warmed = []
    for case in cases:
        try:
            for _ in range(cfg.warmup):
                run_once(case, Clock(device, queued=False))
            warmed.append(case.name)
        except Exception as e:  # measure_layer reports it as skipped in the timing pass
            not_warmed[case.name] = f"{type(e).__name__}: {e}".splitlines()[0]
            m, d, f, _ = cfg.shape
            log.warning("pre-warm M=%d D=%d F=%d: %s failed: %s", m, d, f, case.name, e)
        finally:
            case.reset()  # its grads would otherwise stay while the next variant runs
    return warmed, not_warmed
