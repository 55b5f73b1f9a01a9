"""The paired step timer: phases, the host-bound rule, and the GPU hold (CUDA only)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from swiglu_train.bench import timing

CPU = torch.device("cpu")


def sleeping_case(name: str, fwd_s: float, bwd_s: float) -> timing.Case:
    return timing.Case(name, lambda: time.sleep(fwd_s), lambda _: time.sleep(bwd_s), lambda: None)


def test_a_step_is_timed_per_phase_and_full_is_the_larger_of_gpu_and_host():
    fwd, bwd, gpu, host, full = timing.run_once(sleeping_case("a", 0.02, 0.01), timing.Clock(CPU))
    assert fwd >= 19.9 and bwd >= 9.9  # sleep never returns early
    assert gpu == pytest.approx(fwd + bwd, rel=1e-6)
    assert full == max(gpu, host) and host >= gpu * 0.99  # on the CPU the host does the work


def test_paired_samples_keep_each_case_s_phases_in_phase_order():
    cases = [sleeping_case("short", 0.001, 0.0), sleeping_case("long", 0.01, 0.0)]
    times = timing.paired_samples(cases, 5, CPU, seed=1)
    assert set(times) == {"short", "long"}
    assert list(times["long"]) == list(timing.PHASES)
    assert all(len(v) == 5 for v in times["long"].values())
    # each sample in its own case: a 10 ms sleep never returns early, and a 1 ms one only
    # rarely runs past it on a loaded machine (the median says which case took longer)
    assert times["long"]["full"].min() >= 9.9
    assert np.median(times["long"]["full"]) > np.median(times["short"]["full"])


def test_the_hold_grows_to_twice_a_host_time_that_nears_it():
    clock = timing.Clock(CPU)
    assert clock.hold_ms == 0  # no GPU to hold
    clock.hold_ms = timing.QUEUE_MS
    clock.saw_host(0.4 * timing.QUEUE_MS)
    assert clock.hold_ms == timing.QUEUE_MS
    clock.saw_host(0.6 * timing.QUEUE_MS)
    assert clock.hold_ms == pytest.approx(1.2 * timing.QUEUE_MS)


def test_the_hold_starts_where_the_caller_asks_and_only_on_a_queued_gpu_clock(monkeypatch):
    cuda = torch.device("cuda")  # a Clock only reads the device's type: no GPU needed
    assert timing.Clock(cuda).hold_ms == timing.QUEUE_MS
    assert timing.Clock(cuda, hold_ms=0.5).hold_ms == 0.5
    assert timing.Clock(cuda, queued=False, hold_ms=0.5).hold_ms == 0
    assert timing.Clock(CPU, hold_ms=0.5).hold_ms == 0
    made = []

    class Recorded(timing.Clock):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(args)

    monkeypatch.setattr(timing, "Clock", Recorded)
    timing.paired_samples([sleeping_case("a", 0, 0)], 1, CPU, hold_ms=0.5)
    assert made == [(CPU, True, 0.5)]


@pytest.mark.gpu
@pytest.mark.gpu_alone  # another process's kernels would hold the idle clock's start event
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_queued_step_does_not_count_the_host_s_latency_to_its_first_kernel():
    """A forward that idles the host 5 ms before its first kernel: timed from an idle GPU the
    5 ms count, queued behind the hold they do not (and host records them)."""
    a = torch.randn(256, 256, device="cuda")

    def forward():
        time.sleep(0.005)
        return a @ a

    case = timing.Case("late", forward, lambda _: None, lambda: None)
    idle = timing.run_once(case, timing.Clock(torch.device("cuda"), queued=False))
    queued = timing.run_once(case, timing.Clock(torch.device("cuda")))
    assert idle[2] > 4.5 and queued[2] < 1.0
    assert queued[3] > 4.5 and queued[4] == queued[3]  # full: host-bound at 5 ms


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
def test_without_a_gpu_no_step_waits_on_one_and_none_is_run_to_find_out():
    def forward():
        raise AssertionError("run")

    assert (
        timing.step_waits_on_gpu(timing.Case("a", forward, lambda _: None, lambda: None)) is False
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_that_reads_a_gpu_value_on_the_host_is_timed_from_an_idle_gpu():
    """A forward that reads a count with .item() waits on the GPU: behind the hold, its host
    time would be the hold's. It is found by torch's sync debug mode and gets an idle clock."""
    a = torch.randn(256, 256, device="cuda")
    reads = timing.Case("reads", lambda: a[: int((a > 0).sum().item()) % 256] @ a,
                        lambda _: None, lambda: None)  # fmt: skip
    plain = timing.Case("plain", lambda: a @ a, lambda _: None, lambda: None)
    assert timing.step_waits_on_gpu(reads) and not timing.step_waits_on_gpu(plain)
    assert torch.cuda.get_sync_debug_mode() == 0  # the mode is put back
    reads.waits_on_gpu = True
    times = timing.paired_samples([reads, plain], 3, torch.device("cuda"))
    # idle-started, the reading step's host time is its own (well under the 10 ms hold)
    assert (times["reads"]["host"] < 0.5 * timing.QUEUE_MS).all()


@pytest.mark.gpu
@pytest.mark.gpu_alone  # another process's kernels would fill the gap
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_timeline_shows_where_a_step_waits_on_its_host():
    """Two kernels with 3 ms of host work between them: the hold covers the host's lead, not a
    gap inside the step, so the second kernel's idle gap shows those 3 ms."""
    a = torch.randn(512, 512, device="cuda")

    def forward():
        b = a @ a
        torch.cuda.synchronize()  # the host falls behind the GPU here
        time.sleep(0.003)
        return b + 1

    rows = timing.kernel_timeline(timing.Case("gap", forward, lambda _: None, lambda: None))
    assert len(rows) == 2 and rows[0]["gap_before_us"] == 0.0
    assert 2500 < rows[1]["gap_before_us"] < 20000 and rows[0]["us"] > 0


def test_fresh_calls_each_get_inputs_no_other_call_has_written():
    """An in-place call doubles its input; were inputs shared, later samples would see 2**k."""
    seen: list[float] = []

    def double_in_place(t: torch.Tensor) -> None:
        seen.append(t.item())
        t.mul_(2)

    calls = {"a": double_in_place, "b": double_in_place}
    times = timing.paired_fresh_calls(calls, lambda: (torch.ones(()),), 4, CPU, seed=2)
    assert seen == [1.0] * 8
    assert {name: t.shape for name, t in times.items()} == {"a": (4,), "b": (4,)}
