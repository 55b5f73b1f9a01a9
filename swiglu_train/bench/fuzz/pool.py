"""Run fuzz cases (:mod:`swiglu_train.bench.fuzz.run`) in spawned worker processes.

One process on the H200 ran ~0.7 cases/s, its time mostly in Triton and quack JIT compiles,
which are CPU-bound; workers overlap them. Cases are submitted in case order, at most one per
worker at a time, so that a case past the deadline is never started, the cases in flight are
known when a worker dies, and the outcomes go back into case order at the end.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
import pkgutil
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import torch

from swiglu_train.bench.fuzz import run as fuzz
from swiglu_train.bench.fuzz.cases import Case
from swiglu_train.bench.fuzz.run import Outcome


def quick_autotune() -> int:
    """Have every autotuned Triton kernel of the package time each candidate in a few runs
    instead of Triton's 100 ms (which config wins does not change what a kernel must compute);
    returns how many autotuners it changed."""
    import triton
    from triton.runtime.autotuner import Autotuner

    import swiglu_train.kernels as kernels

    bench = functools.partial(triton.testing.do_bench, warmup=1, rep=2)
    changed = 0
    for info in pkgutil.iter_modules(kernels.__path__, f"{kernels.__name__}."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # a kernel module of an optional package absent or broken here (quack)
            continue
        for obj in vars(module).values():
            if isinstance(obj, Autotuner):
                obj.do_bench = bench  # replaces Triton's cached do_bench for this kernel
                changed += 1
    return changed


def init_worker(tune_quick: bool) -> None:
    """Once per worker, as a single-process run does before its first case. TRITON_INTERPRET
    comes from the parent's environment (:func:`run_cases_pool` sets it for a CPU run): a
    worker defines the kernels when it first imports swiglu_train, before this runs."""
    if tune_quick:
        quick_autotune()


def run_in_worker(
    case: Case, device: str, deadline: float | None
) -> tuple[int, Outcome | None, str | None]:
    """(this worker's pid, the case's outcome, or None where it would start after
    ``deadline`` (a time.time()), and the error that left the CUDA context unusable after it)."""
    if deadline is not None and time.time() > deadline:
        return os.getpid(), None, None
    outcome = fuzz.run_case(case, device)
    return os.getpid(), outcome, fuzz.context_failure(outcome, device)


def run_cases_pool(
    cases: Sequence[Case],
    device: torch.device | str,
    workers: int,
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    max_seconds: float | None = None,
    tune_quick: bool = False,
) -> tuple[list[Outcome], str | None]:
    """:func:`fuzz.run_cases` in ``workers`` spawned processes: ``on_outcome`` sees each outcome
    as it completes; returns them in case order, and why the run stopped early (None: all
    ran), with how many cases did not run. No case starts ``max_seconds`` after this call; a
    worker that dies, or a CUDA context that fails, stops the run."""
    device = torch.device(device)
    if device.type == "cpu":  # workers inherit it before their first import defines the kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
    deadline = None if max_seconds is None else time.time() + max_seconds
    late = None if max_seconds is None else f"stopped after {max_seconds:g} s (--max-seconds)"
    done: dict[int, Outcome] = {}
    running: dict[Future, int] = {}  # each case in flight: its index
    stopped, submitted = None, 0
    spawn = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, spawn, initializer=init_worker, initargs=(tune_quick,))
    with pool:
        while True:
            while stopped is None and len(running) < workers and submitted < len(cases):
                if deadline is not None and time.time() > deadline:
                    stopped = late
                    break
                try:
                    future = pool.submit(run_in_worker, cases[submitted], str(device), deadline)
                except BrokenProcessPool as e:
                    stopped = _died(e, cases, running.values())
                    break
                running[future] = submitted
                submitted += 1
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in sorted(finished, key=running.get):
                i = running.pop(future)
                try:
                    pid, outcome, failure = future.result()
                except BrokenProcessPool as e:
                    stopped = stopped or _died(e, cases, [i, *running.values()])
                    continue
                if outcome is None:
                    stopped = stopped or late
                    continue
                done[i] = outcome
                on_outcome(outcome)
                if failure and not stopped:
                    stopped = f"the CUDA context of worker {pid} failed after case {i}: {failure}"
    outcomes = [done[i] for i in sorted(done)]
    if stopped:
        stopped += f"; {len(cases) - len(outcomes)} of {len(cases)} cases not run"
    return outcomes, stopped


def _died(error: BrokenProcessPool, cases: Sequence[Case], in_flight: Iterable[int]) -> str:
    """Why the run stopped when a worker died: the error and the cases in flight (one of which
    it was running), each as the JSON that replays it alone."""
    named = "; ".join(f"case {i} {cases[i].to_json()}" for i in sorted(in_flight)) or "none"
    return f"a worker process died ({type(error).__name__}: {error}); in flight: {named}"
