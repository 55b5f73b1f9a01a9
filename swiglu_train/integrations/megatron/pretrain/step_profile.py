"""``--profile-step N``: one training step under torch.profiler, written as a per-kernel table.

Where a step's time goes, as data a benchmark can commit and compare across impls (Megatron's
stock MLP against ours, say) without a trace viewer: on CUDA, each kernel's total time and
launch count in that step; on the CPU, each op's self time and count (self time, so that
nested ops are not counted twice).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from swiglu_train.files import write_json_atomic

TOP = 60  # rows kept: the rest of a step's kernels are summed into "other_us"


@contextlib.contextmanager
def step_profile(enabled: bool, cuda: bool) -> Iterator[profile | None]:
    """A profiler around the step when ``enabled`` (CUDA kernels with ``cuda``), else None."""
    if not enabled:
        yield None
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield prof


def summarize(prof: profile, cuda: bool) -> dict:
    """Per kernel (CUDA) or per op (CPU): total µs and count, largest first. On CUDA also the
    host's side (``host``): each op's and runtime call's self time, where a step whose GPU
    sits idle between kernels spends it (Megatron's stock MLP: the same kernel time as ours,
    a longer step)."""
    host = _table({e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()})
    if not cuda:
        return {"unit": "op (self time)", **host}
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += e.time_range.elapsed_us()
            kernels[e.name][1] += 1
    return {"unit": "kernel", **_table(kernels), "host": host}


def _table(totals: dict[str, tuple[float, int] | list[float]]) -> dict:
    ranked = sorted(((n, t) for n, t in totals.items() if t[0] > 0), key=lambda kv: -kv[1][0])
    return {
        "total_us": sum(us for _, (us, _) in ranked),
        "entries": [{"name": n, "us": us, "count": c} for n, (us, c) in ranked[:TOP]],
        "other_us": sum(us for _, (us, _) in ranked[TOP:]),
    }


def write_profile(prof: profile, path: str, step: int, seconds: float, cuda: bool, **about):
    """The step's table, its wall time, and ``about`` (the impl, shapes), atomically."""
    write_json_atomic(path, {"step": step, "step_s": seconds, **about, **summarize(prof, cuda)})
