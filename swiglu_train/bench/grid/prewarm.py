"""The model grid's pre-warm: every point's variants built and run untimed in spawned worker
processes before the timing pass, so that pass finds the compilers' on-disk caches warm.

One timing process paid 46-108 s of compiling at the first M of each new (D, F)
(``benchmarks/results/grid/grid_h200.json``), and 6-12 s at the next M. The compiles are CPU-bound
and every compiler keeps a cache on disk that another process reuses: quack's ``.o`` files
(``QUACK_CACHE_DIR``), Triton's ``~/.triton/cache``, inductor's FX-graph and kernel caches. So N
workers compile N shapes at once. They time nothing and write no results: a variant that fails
in a worker is only logged there, and the timing pass, which compiles whatever is still
missing, reports it as it would have without a pre-warm. A worker that dies costs its point
alone: each worker is a pool of its own, and a fresh one replaces it.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import torch

from swiglu_train.bench.mlp.run import BenchConfig, available_cases, layer_inputs
from swiglu_train.bench.timing import Clock, run_once

log = logging.getLogger(__name__)
WORKER_START_S = 15.0  # spawn, import torch and the peers, a CUDA context (planning estimate)
Shape = tuple[int, int]  # (D, F): a shape compiles once per dtype and variant, whatever its M


@dataclass
class Warmed:
    """What the pre-warm did at one point (for the progress line; never a result)."""

    dims: tuple[int, int, int]  # (M, D, F)
    seconds: float
    pid: int | None = None  # the worker's
    warmed: list[str] = field(default_factory=list)
    not_warmed: dict[str, str] = field(default_factory=dict)  # variant -> why
    error: str | None = None  # the worker died, or its CUDA context failed: it is replaced

    def describe(self) -> str:
        m, d, f = self.dims
        text = f"M={m} D={d} F={f}: {self.seconds:.0f} s"
        text += f" in worker {self.pid}" if self.pid is not None else ""
        if self.not_warmed:
            text += f"; not warmed: {', '.join(self.not_warmed)}"
        if self.error:
            text += f"; {self.error} (the timing pass compiles what is missing)"
        return text


def release(device: torch.device) -> None:
    """Free a point's weights and compiled graphs before the next shape: each point compiles
    its own static shape (dynamo would otherwise recompile the same code with dynamic sizes,
    and fall back to eager past its recompile limit) from an empty allocator cache."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def init_worker(workers: int) -> None:
    """Once per worker: a share of the CPUs for inductor's compile subprocesses, and no
    inductor autotune results on disk, so that the timing pass picks its kernels' configs on
    an idle GPU rather than reusing what a worker measured among the others. Neither setting
    is part of inductor's cache key (``_cache_config_ignore_prefix``)."""
    import torch._inductor.config as inductor

    inductor.compile_threads = max(1, (os.cpu_count() or 1) // workers)
    inductor.autotune_local_cache = False


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
    outcome = Warmed((m, d, f), time.perf_counter() - began, os.getpid(), warmed, not_warmed)
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            outcome.error = f"its CUDA context failed: {e}".splitlines()[0]
    return outcome


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


def pick_next(
    pending: Sequence[int], shapes: Sequence[Shape], started: set[Shape], busy: Counter[Shape]
) -> int | None:
    """The next of ``pending`` (indices into ``shapes``, in order) to warm: first one whose
    (D, F) no worker has started, so distinct shapes spread over the workers; then one whose
    (D, F) no worker is on now (its caches are warm); else None, to wait rather than have two
    workers compile one shape at once."""
    for i in pending:
        if shapes[i] not in started:
            return i
    return next((i for i in pending if not busy[shapes[i]]), None)


def prewarm(
    configs: Sequence[BenchConfig],
    workers: int,
    on_point: Callable[[Warmed], None] = lambda outcome: None,
    task: Callable[[BenchConfig], Warmed] = warm_point,
) -> dict:
    """Warm each of ``configs`` (one per grid point) in ``workers`` spawned processes, largest
    (D, F) first; ``on_point`` sees each point's outcome. Returns the pre-warm's record. All
    workers have exited when this returns, so their GPU memory is free. ``task`` is what a
    worker runs per point (tests put a crash there)."""
    if workers < 1:
        raise ValueError(f"pre-warm workers must be at least 1, got {workers}")
    began = time.perf_counter()
    shapes = [(c.shape[1], c.shape[2]) for c in configs]
    pending = sorted(range(len(configs)), key=lambda i: (-shapes[i][0] * shapes[i][1], i))
    started: set[Shape] = set()
    busy: Counter[Shape] = Counter()
    pools: list[ProcessPoolExecutor | None] = [None] * workers
    running: dict[Future, tuple[int, int, float]] = {}  # -> (worker slot, point, its start)
    errors = []
    try:
        while pending or running:
            for slot in sorted(set(range(workers)) - {s for s, _, _ in running.values()}):
                i = pick_next(pending, shapes, started, busy)
                if i is None:
                    break
                pending.remove(i)
                started.add(shapes[i])
                busy[shapes[i]] += 1
                pools[slot], future = _submit(pools[slot], workers, task, configs[i])
                running[future] = (slot, i, time.perf_counter())
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                slot, i, submitted = running.pop(future)
                busy[shapes[i]] -= 1
                outcome = _outcome(future, configs[i], submitted)
                if outcome.error:  # a fresh process for this slot's next point
                    pools[slot].shutdown(wait=True)
                    pools[slot] = None
                    errors.append(outcome.describe())
                on_point(outcome)
    finally:
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
    return {
        "workers": workers,
        "elapsed_s": round(time.perf_counter() - began, 1),
        "points": len(configs),
        "worker_errors": errors,
    }


def makespan_s(shape_costs: Iterable[float], workers: int) -> float:
    """Estimated seconds of a pre-warm whose (D, F) each cost ``shape_costs`` in one worker:
    the largest given first to the least-loaded worker, after the workers start."""
    loads = [0.0] * workers
    for cost in sorted(shape_costs, reverse=True):
        loads[loads.index(min(loads))] += cost
    return WORKER_START_S + max(loads)


def _pool(workers: int) -> ProcessPoolExecutor:
    """One worker process in a pool of its own: a crash breaks only that pool (a shared pool
    terminates every worker when one dies)."""
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(1, spawn, initializer=init_worker, initargs=(workers,))


def _submit(
    pool: ProcessPoolExecutor | None, workers: int, task: Callable, cfg: BenchConfig
) -> tuple[ProcessPoolExecutor, Future]:
    """``task(cfg)`` in ``pool``, or in a fresh one where there is none or its process died
    while idle (killed between points)."""
    if pool is not None:
        try:
            return pool, pool.submit(task, cfg)
        except BrokenProcessPool:
            pool.shutdown(wait=True)
    pool = _pool(workers)
    return pool, pool.submit(task, cfg)


def _outcome(future: Future, cfg: BenchConfig, submitted: float) -> Warmed:
    try:
        return future.result()
    except BrokenProcessPool as e:  # it died: a compiler's or the driver's crash, or a kill
        error = f"the worker died: {type(e).__name__}: {e}"
    except Exception as e:  # the task itself could not run there
        error = f"the worker failed: {type(e).__name__}: {e}"
    m, d, f, _ = cfg.shape
    return Warmed((m, d, f), time.perf_counter() - submitted, error=error.splitlines()[0])
