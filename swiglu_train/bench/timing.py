"""Paired, randomly ordered timing and allocator readings for fwd+bwd cases.

Every sample runs every case once, in a fresh random order, so drift in clocks or thermals
hits all cases alike; ratios are then taken per sample (paired) before the median.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

PHASES = ("fwd", "bwd", "full")
MiB = 2**20


@dataclass
class Case:
    """One thing to time: a forward returning what backward consumes, and a grad reset."""

    name: str
    forward: Callable[[], object]
    backward: Callable[[object], None]
    reset: Callable[[], None]


class Clock:
    """CUDA events on the GPU (no host sync inside the timed region), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        return start.elapsed_time(end)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def run_once(case: Case, clock: Clock) -> tuple[float, float, float]:
    """(fwd, bwd, full) milliseconds of one step, grads reset outside the timed region."""
    case.reset()
    clock.sync()
    t0 = clock.mark()
    out = case.forward()
    t1 = clock.mark()
    case.backward(out)
    t2 = clock.mark()
    clock.sync()
    del out
    return clock.ms(t0, t1), clock.ms(t1, t2), clock.ms(t0, t2)


def paired_samples(
    cases: Sequence[Case],
    samples: int,
    device: torch.device,
    seed: int = 0,
    on_sample: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, np.ndarray]]:
    """Times of every case for each phase, shape [samples], in the same sample order."""
    clock = Clock(device)
    rng = np.random.default_rng(seed)
    times = {c.name: np.zeros((len(PHASES), samples)) for c in cases}
    for s in range(samples):
        for i in rng.permutation(len(cases)):
            times[cases[i].name][:, s] = run_once(cases[i], clock)
        on_sample()
    return {name: dict(zip(PHASES, t, strict=True)) for name, t in times.items()}


def memory_mib(case: Case, device: torch.device) -> tuple[float | None, float | None]:
    """(after-forward, peak) MiB above what was allocated before forward; None off CUDA.

    Inputs, weights and grad_output already exist; parameter grads are reset to None, so the
    weight-gradient buffers a real first micro-batch allocates count towards the peak.
    """
    if device.type != "cuda":
        return None, None
    case.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = case.forward()
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated() - base
    case.backward(out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    case.reset()
    return after_forward / MiB, peak / MiB
