"""One training step of the recipe: Megatron's forward-backward schedule over the
micro-batches, the loss, and the optimizer step, timed with the GPU's work; the training loop
(``train.py``) and the planner (``plan.py``) run it alike."""

from __future__ import annotations

import os
import resource
import time
from functools import partial
from pathlib import Path

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from swiglu_train.memory import MemoryProfiler


def loss_func(loss_mask: torch.Tensor, on_first: list, output: torch.Tensor):
    """Mean token loss; the first call marks the end of the profiled forward."""
    if on_first:
        on_first.pop()()
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    # A copy: Megatron divides the returned loss by the micro-batch count in place, which a
    # detached view would follow (the logged loss was loss / --num-microbatches).
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(device: torch.device | None, on_first: list, host: dict, data_iterator, model):
    """One micro-batch's forward; its host time is added to ``host``, split into the batch's
    collate (the DataLoader's), its copy to the device (pageable: a stream sync) and the
    model's forward."""
    tic = time.perf_counter()
    collated = next(data_iterator)
    fetched = time.perf_counter()
    batch = {k: v.to(device) if device else v for k, v in collated.items()}
    copied = time.perf_counter()
    mask = batch.get("attention_mask")  # None: the attention's own causal mask
    output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
    host["collate_s"] += fetched - tic
    host["copy_s"] += copied - fetched
    host["forward_s"] += time.perf_counter() - copied
    return output, partial(loss_func, batch["loss_mask"].float(), on_first)


def _thread_counters() -> dict[str, float]:
    """This thread's CPU time, minor page faults and context switches so far (Linux's
    per-thread usage; the process's elsewhere)."""
    usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return {
        "cpu_s": time.thread_time(),
        "minor_faults": usage.ru_minflt,
        "involuntary_switches": usage.ru_nivcsw,
        "voluntary_switches": usage.ru_nvcsw,
    }


def host_threads() -> dict[str, int]:
    """What the process's CPU work runs on: torch's intra-op threads, the cores it may use, and
    its OS threads (Linux; -1 elsewhere), which a stage that spawned pools (torch.compile's)
    may change."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.exists() else []
    threads = [int(line.split()[1]) for line in lines if line.startswith("Threads:")]
    return {
        "torch_threads": torch.get_num_threads(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1,
        "os_threads": threads[0] if threads else -1,
    }


def run_step(args, model, optimizer, data, profiler: MemoryProfiler | None, step: int):
    """One optimizer step of Megatron's schedule over --num-microbatches micro-batches:
    (each micro-batch's loss stats on the last stage, the profiler's record or None, the
    step's seconds by phase, the schedule's host figures). The phases, whose sum is the step
    with the GPU's work included, are the host's wall time in the schedule (forward and
    backward queued), in the optimizer step (its ``.item()`` reads wait for the GPU) and in the
    final sync: where a step whose GPU waits on the host loses its time. The schedule's host
    figures say what held a slow schedule: its wall time collating batches, copying them to
    the device and in the model's forward, and the main thread's CPU seconds, minor page
    faults and context switches in it (a thread descheduled or faulting in fresh pages shows
    there, a GPU sync as voluntary switches)."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    host = {"collate_s": 0.0, "copy_s": 0.0, "forward_s": 0.0}
    before = _thread_counters()
    tic = time.perf_counter()
    on_first = []
    if profiler is not None:
        profiler.begin(step)
        on_first.append(profiler.forward_done)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    stats = get_forward_backward_func()(
        forward_step_func=partial(forward_step, device, on_first, host),
        data_iterator=data,
        model=[model],
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    record = profiler.backward_done() if profiler is not None else None
    scheduled = time.perf_counter()
    after = _thread_counters()
    host |= {f"schedule_{k}": after[k] - before[k] for k in after}
    optimizer.step()
    stepped = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    done = time.perf_counter()
    phases = {"schedule_s": scheduled - tic, "optimizer_s": stepped - scheduled,
              "sync_s": done - stepped}  # fmt: skip
    return stats, record, phases, host
