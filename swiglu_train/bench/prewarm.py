"""The benchmarks' pre-warm pool: each point's variants built and run untimed in spawned worker
processes before the timing pass, so that pass finds the compilers' on-disk caches warm.

The compiles are CPU-bound and every compiler keeps a cache on disk that another process
reuses: quack's ``.o`` files (``QUACK_CACHE_DIR``), Triton's ``~/.triton/cache``, inductor's
FX-graph and kernel caches. So N workers compile N shapes at once. They time nothing and write
no results: a variant that fails in a worker is only logged there, and the timing pass, which
compiles whatever is still missing, reports it as it would have without a pre-warm. A worker
that dies costs its point alone: each worker is a pool of its own, and a fresh one replaces it.

What a point is belongs to its benchmark (``bench/grid/prewarm.py``, ``bench/moe/prewarm.py``):
here a point is a ``Job``, with the shape it compiles and the GPU memory it holds.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import torch

WORKER_START_S = 15.0  # spawn, import torch and the peers, a CUDA context (planning estimate)


@dataclass
class Warmed:
    """What the pre-warm did at one point (for the progress line; never a result)."""

    label: str  # the point, as its benchmark names it
    seconds: float
    pid: int | None = None  # the worker's
    warmed: list[str] = field(default_factory=list)
    not_warmed: dict[str, str] = field(default_factory=dict)  # variant -> why
    error: str | None = None  # the worker died, or its CUDA context failed: it is replaced

    def describe(self) -> str:
        text = f"{self.label}: {self.seconds:.0f} s"
        text += f" in worker {self.pid}" if self.pid is not None else ""
        if self.not_warmed:
            text += f"; not warmed: {', '.join(self.not_warmed)}"
        if self.error:
            text += f"; {self.error} (the timing pass compiles what is missing)"
        return text


@dataclass(frozen=True)
class Job:
    """One point for a worker: ``config`` is what its task receives (picklable)."""

    config: Any
    label: str
    shape: Hashable  # what compiles once: two workers never compile one shape at once
    size: float  # larger first: the longest compiles start soonest
    gpu_bytes: int = 0  # what the point holds on the GPU at most (0: not counted)


def init_worker(workers: int) -> None:
    """Once per worker: a share of the CPUs for inductor's compile subprocesses, and no
    inductor autotune results on disk, so that the timing pass picks its kernels' configs on
    an idle GPU rather than reusing what a worker measured among the others. Neither setting
    is part of inductor's cache key (``_cache_config_ignore_prefix``)."""
    import torch._inductor.config as inductor

    inductor.compile_threads = max(1, (os.cpu_count() or 1) // workers)
    inductor.autotune_local_cache = False


def worker_outcome(
    label: str, began: float, warmed: list[str], not_warmed: dict[str, str], device: torch.device
) -> Warmed:
    """A task's outcome once it has freed its point: a CUDA context that failed becomes its
    error, so that the pool replaces the worker rather than hand it the next point."""
    outcome = Warmed(label, time.perf_counter() - began, os.getpid(), warmed, not_warmed)
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            outcome.error = f"its CUDA context failed: {e}".splitlines()[0]
    return outcome


def pick_next(
    pending: Sequence[int],
    shapes: Sequence[Hashable],
    started: set[Hashable],
    busy: Counter[Hashable],
    fits: Callable[[int], bool] = lambda i: True,
) -> int | None:
    """The next of ``pending`` (indices into ``shapes``, in order) to warm among those that
    ``fits`` the GPU memory left: first one whose shape no worker has started, so distinct
    shapes spread over the workers; then one whose shape no worker is on now (its caches are
    warm); else None, to wait rather than have two workers compile one shape at once."""
    ready = [i for i in pending if fits(i)]
    for i in ready:
        if shapes[i] not in started:
            return i
    return next((i for i in ready if not busy[shapes[i]]), None)


def prewarm(
    jobs: Sequence[Job],
    workers: int,
    task: Callable[[Any], Warmed],
    on_point: Callable[[Warmed], None] = lambda outcome: None,
    gpu_budget: int | None = None,
) -> dict:
    """Run ``task(job.config)`` for each of ``jobs`` in ``workers`` spawned processes, largest
    first; ``on_point`` sees each point's outcome. With ``gpu_budget`` (bytes), a job starts
    only while the jobs running hold at most that together, or when it would run alone. All
    workers have exited when this returns, so their GPU memory is free."""
    if workers < 1:
        raise ValueError(f"pre-warm workers must be at least 1, got {workers}")
    began = time.perf_counter()
    shapes = [j.shape for j in jobs]
    pending = sorted(range(len(jobs)), key=lambda i: (-jobs[i].size, i))
    started: set[Hashable] = set()
    busy: Counter[Hashable] = Counter()
    pools: list[ProcessPoolExecutor | None] = [None] * workers
    running: dict[Future, tuple[int, int, float]] = {}  # -> (worker slot, point, its start)
    errors = []

    def fits(i: int) -> bool:
        held = sum(jobs[p].gpu_bytes for _, p, _ in running.values())
        return gpu_budget is None or not running or held + jobs[i].gpu_bytes <= gpu_budget

    try:
        while pending or running:
            for slot in sorted(set(range(workers)) - {s for s, _, _ in running.values()}):
                i = pick_next(pending, shapes, started, busy, fits)
                if i is None:
                    break
                pending.remove(i)
                started.add(shapes[i])
                busy[shapes[i]] += 1
                pools[slot], future = _submit(pools[slot], workers, task, jobs[i].config)
                running[future] = (slot, i, time.perf_counter())
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                slot, i, submitted = running.pop(future)
                busy[shapes[i]] -= 1
                outcome = _outcome(future, jobs[i].label, submitted)
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
        "points": len(jobs),
        "worker_errors": errors,
    }


def makespan_s(shape_costs: Iterable[float], workers: int) -> float:
    """Estimated seconds of a pre-warm whose shapes each cost ``shape_costs`` in one worker:
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
    pool: ProcessPoolExecutor | None, workers: int, task: Callable, config: Any
) -> tuple[ProcessPoolExecutor, Future]:
    """``task(config)`` in ``pool``, or in a fresh one where there is none or its process died
    while idle (killed between points)."""
    if pool is not None:
        try:
            return pool, pool.submit(task, config)
        except BrokenProcessPool:
            pool.shutdown(wait=True)
    pool = _pool(workers)
    return pool, pool.submit(task, config)


def _outcome(future: Future, label: str, submitted: float) -> Warmed:
    try:
        return future.result()
    except BrokenProcessPool as e:  # it died: a compiler's or the driver's crash, or a kill
        error = f"the worker died: {type(e).__name__}: {e}"
    except Exception as e:  # the task itself could not run there
        error = f"the worker failed: {type(e).__name__}: {e}"
    return Warmed(label, time.perf_counter() - submitted, error=error.splitlines()[0])
