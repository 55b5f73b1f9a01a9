"""torch.compile's compile workers, released once a run's compiling is done.

Inductor compiles Triton kernels in a pool of worker processes, as many as the process may use
cores (up to 32), which PyTorch keeps for 60 s after the last compile
(``torch._inductor.config.quiesce_async_compile_time``). A training step has CPU work on its
critical path, and on a box whose cores those workers share it slows down. Measured on the
H200 box (16 cores, torch 2.11): stock Megatron's bias-SwiGLU, the recipe's one
``torch.compile``'d function, starts the pool in the first step; while the workers lived, the
DataLoader's collate (an OpenMP-parallel ``torch.stack`` of the 32 MiB attention mask) took
67 ms a step instead of 4-10, with the GPU idle after the previous step's sync. That was stock's
0.80x in the end-to-end table, and its bimodality: the runs whose workers went quiet early were
fast (docs/planner.md). Newer PyTorch quiesces the pool as each compile ends
(pytorch/pytorch#183003); releasing it after the warm-up steps gives that on any version.
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
