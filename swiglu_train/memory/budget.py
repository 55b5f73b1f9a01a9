"""What the planners of both integrations share besides the decision (``memory.plan``): the
default memory budget, the candidate names, and how a peak was read."""

from __future__ import annotations

import gc
import inspect
import time
import types
from collections.abc import Callable

import torch

from swiglu_train.layers.registry import FP8_LABEL
from swiglu_train.memory.profiler import MiB

MARGIN = 0.05  # the default budget: the device's memory less 5 % (fragmentation, context)
ALLOCATOR = "cuda allocator peak"
ESTIMATE = "model state + saved-for-backward bytes (CPU estimate, no transients)"
LEAK_MiB = 512  # more than lazily made buffers (cuBLAS workspaces) explain; a model is GBs


def split_candidate(name: str) -> tuple[str, bool]:
    """('drop_h', True) for 'drop_h+fp8'; (name, False) otherwise."""
    return (name.removesuffix(FP8_LABEL), True) if name.endswith(FP8_LABEL) else (name, False)


def default_budget_MiB(device: torch.device, budget_gb: float | None) -> float:
    """``budget_gb`` in MiB, else the CUDA device's memory less MARGIN; a CPU plan needs one."""
    if budget_gb is not None:
        return budget_gb * 1024
    if device.type != "cuda":
        raise ValueError("a CPU plan needs an explicit memory budget (--memory-budget-gb)")
    return torch.cuda.get_device_properties(device).total_memory * (1 - MARGIN) / MiB


def check_freed(
    before: int, what: str, settle_s: float = 2.0, kept: Callable[[], int] = lambda: 0
) -> None:
    """Raise if CUDA memory did not come back to ``before`` bytes (within LEAK_MiB) once
    ``what`` (a measured model) was freed: peaks are absolute, so whatever it left behind
    would count in every later peak, and the plan would be wrong. ``before`` and the reading
    after both leave out ``kept()`` bytes: a process-wide cache that the first point fills and
    every later point and the run itself reuse (Megatron's global memory buffer) is the run's
    own memory, not the point's leak.

    Memory can come back late: a process group may keep a finished collective's tensors
    until its watchdog thread retires the work. So wait up to ``settle_s`` before calling it
    a leak; the error then lists the largest CUDA tensors still alive, to find the holder."""
    deadline = time.monotonic() + settle_s
    while (held := (torch.cuda.memory_allocated() - kept() - before) / MiB) > LEAK_MiB:
        if time.monotonic() >= deadline:
            alive = _live_cuda_tensors()
            raise RuntimeError(f"the planner's {what} left {held:,.0f} MiB allocated after it "
                               "was freed: every later peak would count it, so the plan would "
                               f"be wrong. Largest CUDA tensors alive: {alive}")  # fmt: skip
        time.sleep(0.1)
        gc.collect()


def _live_cuda_tensors(top: int = 5) -> str:
    """The ``top`` largest CUDA storages that Python's collector can see, with their shape and
    what holds the largest (``_holders``)."""
    seen, biggest, biggest_bytes = {}, None, -1
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.is_cuda:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = (storage.nbytes(), tuple(obj.shape), obj.dtype)
            if storage.nbytes() > biggest_bytes:
                biggest, biggest_bytes = obj, storage.nbytes()
    if biggest is None:
        return "none"
    largest = sorted(seen.values(), key=lambda v: v[0], reverse=True)[:top]
    listed = ", ".join(f"{n / MiB:,.0f} MiB {list(shape)} {dtype}" for n, shape, dtype in largest)
    return f"{listed}; the largest is held by {_holders(biggest)}"


def _holders(obj: object, depth: int = 3, _ours: tuple[int, ...] = ()) -> str:
    """Who references ``obj``, as ``Owner.attribute`` (and ``[key] of`` a dict's holder), up to
    ``depth`` referrers up: the name to look for in the code that keeps it. The lists this
    search makes are left out."""
    refs = gc.get_referrers(obj)
    ours = (*_ours, id(refs))
    names = []
    for ref in refs:
        if id(ref) in ours or inspect.isframe(ref) or isinstance(ref, types.CellType):
            continue  # this search's lists, and a function's locals: no owner to name
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is obj), "?")
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
            if owners:
                names += [f"{type(o).__name__}.{key}" for o in owners]
            elif depth > 1:
                names.append(f"[{key!r}] of ({_holders(ref, depth - 1, ours)})")
            else:
                names.append(f"dict[{key!r}]")
        elif isinstance(ref, (list, tuple)) and depth > 1:
            names.append(f"{type(ref).__name__} in ({_holders(ref, depth - 1, ours)})")
        else:  # an object with inline attributes refers directly
            keys = [k for k, v in getattr(ref, "__dict__", {}).items() if v is obj]
            names.append(type(ref).__name__ + (f".{keys[0]}" if keys else ""))
    return ", ".join(names[:6]) or "nothing Python sees (a C++ holder)"
