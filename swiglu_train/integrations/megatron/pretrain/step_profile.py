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
    """Per kernel (CUDA) or per op (CPU): total µs and count, largest first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name][0] += e.time_range.elapsed_us()
                totals[e.name][1] += 1
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                totals[e.key] = [e.self_cpu_time_total, e.count]
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "unit": "kernel" if cuda else "op (self time)",
        "total_us": sum(us for us, _ in totals.values()),
        "entries": [{"name": n, "us": us, "count": c} for n, (us, c) in ranked[:TOP]],
        "other_us": sum(us for _, (us, _) in ranked[TOP:]),
    }


def write_profile(prof: profile, path: str, step: int, seconds: float, cuda: bool, **about):
    """The step's table, its wall time, and ``about`` (the impl, shapes), atomically."""
    write_json_atomic(path, {"step": step, "step_s": seconds, **about, **summarize(prof, cuda)})
