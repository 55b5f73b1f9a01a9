"""torch.compile's compile workers, released once a run's compiling is done.

At a process's first compile, Inductor starts its compile-worker pool in the background: a
sidecar process that imports torch and forks up to one worker per core (32 at most), kept
until 60 s after the last compile (``torch._inductor.config.quiesce_async_compile_time``).
Training goes on meanwhile, and a step has CPU work on its critical path that the pool's
start-up slows. Measured on the H200 box (16 cores, torch 2.11, ``benchmarks/results/e2e``):
stock Megatron's bias-SwiGLU, the recipe's one ``torch.compile``'d function, starts the pool
in the first step; ``top`` showed a second Python process at 32-117 % of a core in stock's
runs alone. While it lived, the DataLoader's collate (an intra-op-parallel ``torch.stack`` of
the 32 MiB attention mask, whose threads wait on any one the pool preempts) took 67 ms a step
instead of 4-5, with the GPU idle after the previous step's sync: stock's 0.80x of earlier
tables, and its bimodality (runs whose pool settled early went fast mid-run). With one OpenMP
thread, or with no pool (``TORCHINDUCTOR_COMPILE_THREADS=1``), stock ran as fast as ours.
Releasing the pool after the warm-up steps removes it on any PyTorch version; newer ones
quiesce the pool as each compile ends (pytorch/pytorch#183003).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def release_compile_workers() -> int:
    """Shut down Inductor's compile-worker pools, where this process started any; the number
    of its descendant processes that ended. A later compile starts a new pool."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None:  # nothing was ever compiled: no pool to release
        return 0
    before = descendants()
    async_compile.shutdown_compile_workers()
    return len(before - descendants())


def descendants(pid: int | None = None) -> set[int]:
    """The processes below ``pid`` (default: this one), from Linux's /proc; none elsewhere."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces and parentheses
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended while being read
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found
