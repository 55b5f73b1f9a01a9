"""Paired, randomly ordered timing and allocator readings for fwd+bwd cases.

Every sample runs every case once, in a fresh random order, so drift in clocks or thermals
hits all cases alike; ratios are then taken per sample (paired) before the median.

On CUDA each step is timed behind a spin kernel that holds the GPU while the host queues the
step, as in training, where the host runs layers ahead of the GPU. Without it, the first event
is recorded on an idle GPU and every case's time includes its host latency to the first kernel,
which a training step hides, and a GPU not yet at its pace (the floor's six GEMMs at
[8192, 4096, 14336]: 13.1 ms timed from idle, 11.0 ms queued). A step's time (``full``) is then
the larger of the GPU's time (``gpu``) and the host's time to queue it (``host``): what a loop
of such steps sustains, so a host-bound step is charged its host time.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

PHASES = ("fwd", "bwd", "gpu", "host", "full")
MiB = 2**20
TIMING_DEFINITION = (
    "CUDA events around fwd and bwd (gpu = fwd + bwd), each step queued behind a spin kernel so "
    "that host latency before the first kernel is not counted (a step that reads GPU values on "
    "the host is timed from an idle GPU instead); host = the host's time to queue the step; "
    "full = max(gpu, host), the step time a loop of such steps sustains"
)
PEAK_DEFINITION = (  # what memory_mib reads
    "max allocated during fwd+bwd minus allocated before forward; "
    "inputs, weights and grad_output preallocated, parameter grads reset to None"
)
QUEUE_MS = 10.0  # the spin kernel's first hold; it grows to twice any host time seen
# ... up to this: a step that waits on the GPU inside its forward (a host sync) sees host time
# of at least the hold itself, and would double the hold every sample without it.
MAX_HOLD_MS = 200.0


@dataclass
class Case:
    """One thing to time: a forward returning what backward consumes, and a grad reset.
    ``waits_on_gpu``: its step reads a GPU value on the host (``step_waits_on_gpu``), so it is
    timed from an idle GPU, since behind a spin kernel its host time would be the spin's."""

    name: str
    forward: Callable[[], object]
    backward: Callable[[object], None]
    reset: Callable[[], None]
    waits_on_gpu: bool = False


class Clock:
    """CUDA events on the GPU (no host sync inside the timed region), perf_counter on CPU.

    ``queued`` (CUDA only) starts each step behind a spin kernel of ``hold_ms`` (``QUEUE_MS``),
    lengthened to twice the host time of any step that came close to it. A caller timing one
    kernel a step may start it shorter: the hold is GPU time every sample spends.
    """

    def __init__(
        self, device: torch.device, queued: bool = True, hold_ms: float = QUEUE_MS
    ) -> None:
        self.cuda = device.type == "cuda"
        self.hold_ms = hold_ms if self.cuda and queued else 0.0

    def hold(self) -> None:
        """Keep the GPU busy while the host queues what follows."""
        if self.hold_ms:
            torch.cuda._sleep(int(_cycles_per_ms() * self.hold_ms))

    def saw_host(self, host_ms: float) -> None:
        if self.hold_ms and host_ms > 0.5 * self.hold_ms:
            self.hold_ms = min(2 * host_ms, MAX_HOLD_MS)

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


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured once per process."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        cycles = 10_000_000
        torch.cuda._sleep(cycles)  # the first call also loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = cycles / start.elapsed_time(end)
    return _CYCLES_PER_MS


_CYCLES_PER_MS: float | None = None


def run_once(case: Case, clock: Clock) -> tuple[float, float, float, float, float]:
    """(fwd, bwd, gpu, host, full) milliseconds of one step (as PHASES), grads reset outside
    the timed region; host is how long the host took to queue the step."""
    case.reset()
    clock.sync()
    clock.hold()
    h0 = time.perf_counter()
    t0 = clock.mark()
    out = case.forward()
    t1 = clock.mark()
    case.backward(out)
    t2 = clock.mark()
    host = (time.perf_counter() - h0) * 1e3
    clock.saw_host(host)
    clock.sync()
    del out
    gpu = clock.ms(t0, t2)
    return clock.ms(t0, t1), clock.ms(t1, t2), gpu, host, max(gpu, host)


def step_waits_on_gpu(case: Case) -> bool:
    """Whether one step of ``case`` synchronizes the host with the GPU (``.item()``, a
    ``.tolist()`` of group sizes, ``nonzero``): torch's sync debug mode raises on those. Run it
    after warm-up, since autotuning and compiling synchronize once. False on CPU."""
    if not torch.cuda.is_available():
        return False
    case.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.backward(case.forward())
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        case.reset()
    return False


def paired_samples(
    cases: Sequence[Case],
    samples: int,
    device: torch.device,
    seed: int = 0,
    on_sample: Callable[[], None] = lambda: None,
    queued: bool = True,
    hold_ms: float = QUEUE_MS,
) -> dict[str, dict[str, np.ndarray]]:
    """Times of every case for each phase, shape [samples], in the same sample order. Each case
    has a clock of its own: queued (unless ``queued`` is False) where its step never waits on
    the GPU, from an idle GPU where it does (``Case.waits_on_gpu``); its hold starts at
    ``hold_ms``."""
    clocks = {c.name: Clock(device, queued and not c.waits_on_gpu, hold_ms) for c in cases}
    rng = np.random.default_rng(seed)
    times = {c.name: np.zeros((len(PHASES), samples)) for c in cases}
    for s in range(samples):
        for i in rng.permutation(len(cases)):
            times[cases[i].name][:, s] = run_once(cases[i], clocks[cases[i].name])
        on_sample()
    return {name: dict(zip(PHASES, t, strict=True)) for name, t in times.items()}


def paired_fresh_calls(
    calls: dict[str, Callable[..., object]],
    make_inputs: Callable[[], tuple],
    samples: int,
    device: torch.device,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Milliseconds of each call, shape [samples], every call on inputs made for it alone, in
    a fresh random order per sample: for kernels that write their inputs (in place), whose
    repeated calls on one buffer would time values drifting to inf."""
    clock, rng, names = Clock(device), np.random.default_rng(seed), list(calls)
    times = {name: np.zeros(samples) for name in names}
    for s in range(samples):
        for i in rng.permutation(len(names)):
            inputs = make_inputs()
            clock.sync()
            clock.hold()
            t0 = clock.mark()
            calls[names[i]](*inputs)
            t1 = clock.mark()
            clock.sync()
            times[names[i]][s] = clock.ms(t0, t1)
            del inputs
    return times


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


def _is_hold(kernel: str) -> bool:
    """The clock's own spin kernel (``torch.cuda._sleep``: ``spin_kernel`` on CUDA 12+)."""
    return any(word in kernel.lower() for word in ("sleep", "spin_kernel"))


def kernel_timeline(case: Case, steps: int = 3) -> list[dict]:
    """One step's CUDA kernels in launch order, each with its mean µs over ``steps`` steps and
    the mean µs the GPU sat idle before it (since the step's previous kernel ended): which
    kernel costs what, and where the step waits on its host rather than on a kernel. Each step
    is queued as ``paired_samples`` times it, so a gap is host time the hold did not cover."""
    from torch.profiler import ProfilerActivity, profile

    clock = Clock(torch.device("cuda"), queued=not case.waits_on_gpu)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_once(case, clock)
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not _is_hold(e.name)
    ]
    kernels.sort(key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    rows = []
    for i in range(per_step):
        runs = [kernels[i + s * per_step] for s in range(steps)]
        gaps = [
            max(0.0, k.time_range.start - kernels[i - 1 + s * per_step].time_range.end)
            if i
            else 0.0
            for s, k in enumerate(runs)
        ]
        rows.append({
            "name": runs[0].name[:90],
            "us": round(sum(k.time_range.elapsed_us() for k in runs) / steps, 1),
            "gap_before_us": round(sum(gaps) / steps, 1),
        })  # fmt: skip
    return rows
