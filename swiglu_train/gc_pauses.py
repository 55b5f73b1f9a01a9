"""Time the host spends in Python's garbage collector, per training step.

A step that waits on the host (Megatron's optimizer reads values back with ``.item()`` about a
hundred times a step) turns every host pause into GPU idle time. The collector is such a pause:
its full collections walk every live object, and a process that has compiled with
``torch.compile`` holds millions of them (Inductor, sympy), so one collection can cost tens of
milliseconds. ``gc.callbacks`` reports each collection's start and stop, which names that cost
instead of leaving it as unexplained idle time in a profile.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator


class GcPauses:
    """Accumulates the seconds spent in collections between two ``take()`` calls.

    Use as a context manager so the callback is removed again (it is process-wide)."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._collections = 0
        self._started: float | None = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds += time.perf_counter() - self._started
            self._collections += 1
            self._started = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def take(self) -> tuple[float, int]:
        """(seconds, collections) since the last call, and start counting again."""
        out = (self._seconds, self._collections)
        self._seconds, self._collections = 0.0, 0
        return out


@contextlib.contextmanager
def manual_gc(enabled: bool) -> Iterator[None]:
    """Megatron-LM's ``--manual-gc``: collect once now, then only when the caller does
    (``gc.collect()`` between steps), so no collection lands inside a step. Automatic
    collection comes back on exit: the process may go on (tests, notebooks)."""
    if not enabled:
        yield
        return
    gc.disable()
    gc.collect()
    try:
        yield
    finally:
        gc.enable()
