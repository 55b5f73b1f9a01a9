"""``--activation-checkpointing auto`` in the Megatron recipe: measure short training steps of
the run's own GPTModel, under Megatron's own recompute (``--recompute-granularity full
--recompute-method block --recompute-num-layers N``), and pick the MLP impl and N that fit the
memory budget at the highest tokens/s (the decision: ``swiglu_train.memory.plan``, shared with
the Lightning planner).

Each measured point builds the model and optimizer as the run would (``build.py``), runs
``warmup`` + ``measured`` optimizer steps of the recipe's own step (``step.py``: Megatron's
schedule over --num-microbatches micro-batches, the optimizer, a CUDA sync) on the run's data,
and frees them before the next point. tokens/s is the median over the measured steps; the
peak, on CUDA, the allocator's over each whole step (the memory profiler resets it as a step
begins), in absolute MiB as the budget bounds it. On the CPU there are no allocator figures:
the peak is estimated as the model state (parameters, Megatron's main_grad buffers, optimizer
state; their storages counted once) plus the bytes saved for backward (exact, from the
profiler), a lower bound, so a CPU plan needs an explicit budget.

One process only (``--tp 1 --pp 1 --ep 1``, one rank): the ranks of a parallel run would have
to agree on every measurement and on every out-of-memory step. Plan on one GPU at the run's
shape per rank, then pass the plan's ``--mlp-impl`` and recompute to the parallel run.

An MoE model (``--num-experts``) is planned as any other: its candidates are the routed
experts' impls, each measured with its MoE layers' router, dispatcher and experts under the same
block recompute, and the memory profiler counts the experts' saved bytes.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import asdict, dataclass, replace

import torch
from megatron.core import parallel_state

from swiglu_train.integrations.megatron import SUPPORTED_IMPLS
from swiglu_train.integrations.megatron.pretrain.args import AUTO
from swiglu_train.integrations.megatron.pretrain.build import build_training
from swiglu_train.integrations.megatron.pretrain.data import train_loader
from swiglu_train.integrations.megatron.pretrain.step import run_step
from swiglu_train.layers.registry import QUACK_IMPLS, saved_fp8_labels
from swiglu_train.memory import MemoryProfiler
from swiglu_train.memory.budget import (
    ALLOCATOR,
    ESTIMATE,
    check_freed,
    default_budget_MiB,
    split_candidate,
)
from swiglu_train.memory.plan import (
    Plan,
    Profile,
    accumulation,
    choose_plan,
    micro_batches,
    search,
    search_micro_batches,
)
from swiglu_train.memory.profiler import MiB
from swiglu_train.memory.saved import distinct_bytes
from swiglu_train.ops.experts import IMPLS as EXPERTS_IMPLS


@dataclass(frozen=True)
class Steps:
    """Optimizer steps per measured point: ``warmup`` left out (Triton compilation, autotuning,
    optimizer state allocation), then ``measured`` timed."""

    warmup: int = 2
    measured: int = 3


def candidates(args: argparse.Namespace) -> list[str]:
    """--plan-impls, else every impl of ours that runs here (the quack ones with quack on an
    sm_90+ GPU; in an MoE model, the routed experts' impls, drop_h_quack where its sizes suit
    quack too); with --saved-fp8, the impls that save in FP8 (drop_h_quack+fp8 with quack)."""
    from swiglu_train.ops.experts_quack import experts_quack_unavailable_reason
    from swiglu_train.ops.quack_mlp import quack_available

    if args.plan_impls is not None:
        return args.plan_impls
    quack = quack_available()
    ours = SUPPORTED_IMPLS
    if args.num_experts:
        ours = EXPERTS_IMPLS
        ffn = args.moe_ffn_hidden_size
        quack = experts_quack_unavailable_reason(args.hidden_size, ffn) is None
    if args.saved_fp8:
        return saved_fp8_labels(quack)
    return [i for i in ours if i not in QUACK_IMPLS or quack]


def plan_run(args: argparse.Namespace, steps: Steps = Steps()) -> dict:
    """Measure, choose, and set the chosen impl and recompute on ``args``; returns the plan's
    record (for the summary and the W&B config). Raises ``memory.plan.NoPlanFits`` when
    nothing fits the budget."""
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    budget = default_budget_MiB(device or torch.device("cpu"), args.memory_budget_gb)
    measure = measurer(args, steps)
    if args.micro_batch_size == AUTO:  # each divisor of the global batch, largest first
        sizes = micro_batches(args.global_batch_size)
        profiles = search_micro_batches(candidates(args), args.num_layers, budget, sizes, measure)
    else:
        profiles = search(candidates(args), args.num_layers, budget, measure)
    plan = choose_plan(profiles, budget, args.num_layers)
    impl, fp8 = split_candidate(plan.impl)
    args.mlp_impl, args.saved_fp8 = impl, fp8
    _set_recompute(args, plan.checkpoint_layers)
    if plan.micro_batch_size is not None:
        args.micro_batch_size = plan.micro_batch_size
        args.num_microbatches = accumulation(args.global_batch_size, plan.micro_batch_size)
    return record(plan, profiles, args, steps)


def measurer(args: argparse.Namespace, steps: Steps):
    """``measure(candidate, n, micro_batch=None)``: the run's model with ``n`` blocks
    recomputed (at ``micro_batch``, accumulating to --global-batch-size, where the planner
    chooses the micro-batch), built, stepped and freed (see the module docstring)."""

    cuda = args.device == "cuda"

    def measure(name: str, n: int, micro_batch: int | None = None) -> Profile:
        point = argparse.Namespace(**vars(args))
        point.mlp_impl, point.saved_fp8 = split_candidate(name)
        _set_recompute(point, n)
        point.max_steps = steps.warmup + steps.measured  # the data loader's length
        if micro_batch is not None:
            point.micro_batch_size = micro_batch
            point.num_microbatches = accumulation(args.global_batch_size, micro_batch)
        # Megatron's attention-score buffer is sized by the micro-batch: each point makes its
        # own, so that its peak counts what a run at its micro-batch holds
        parallel_state.get_global_memory_buffer().buffer.clear()
        before = torch.cuda.memory_allocated() if cuda else 0
        try:
            profile = _measure(point, name, n, steps)
            if micro_batch is None:
                return profile
            return replace(profile, micro_batch_size=micro_batch,
                           accumulate_grad_batches=point.num_microbatches)  # fmt: skip
        finally:
            gc.collect()  # the model, its DDP hooks and the optimizer hold each other
            if cuda:
                torch.cuda.empty_cache()
                what = f"{name} model with {n} recomputed layers"
                check_freed(before, what, kept=global_buffer_bytes)

    return measure


def global_buffer_bytes() -> int:
    """Bytes in Megatron's process-wide GlobalMemoryBuffer. Megatron's own attention keeps its
    [b·heads, s, s] score buffer there (1 GiB at micro-batch 8, 16 heads, seq 2048), past the
    point that made it, for the run to reuse: not the point's leak (on the H200 the planner's
    leak check once stopped on it)."""
    buffers = parallel_state.get_global_memory_buffer().buffer.values()
    return sum(t.untyped_storage().nbytes() for t in buffers)


def _measure(args: argparse.Namespace, name: str, n: int, steps: Steps) -> Profile:
    _, model, optimizer = build_training(args)
    try:
        return _steps(args, name, n, steps, model, optimizer)
    finally:
        release_storages(model, optimizer)


def release_storages(model, optimizer) -> None:
    """Free the memory of a measured model and its optimizer now, whoever still references
    them: every storage of ``_state_tensors`` is resized to 0 bytes. Garbage collection alone
    does not do it. With Megatron's DistributedOptimizer the model outlives its point: on the
    CPU the DDP model is then referenced only from its grad-accumulator hooks, which autograd
    holds in C++ where the collector cannot reach them, and on the H200 1,089 MiB stayed
    allocated. Every later point's peak would count that memory."""
    for t in _state_tensors(model, optimizer):
        t.untyped_storage().resize_(0)


def _state_tensors(model, optimizer) -> list[torch.Tensor]:
    """Parameters, their main_grad, DDP's parameter and gradient buffers, and each optimizer's
    parameters (Megatron's fp32 main copies) and state."""
    tensors = list(model.parameters())
    tensors += [p.main_grad for p in tensors if getattr(p, "main_grad", None) is not None]
    for buffer in getattr(model, "buffers", []) + getattr(model, "expert_parallel_buffers", []):
        tensors += [t for t in (buffer.param_data, buffer.grad_data) if t is not None]
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", inner)  # MainGradAdamW's, Megatron's
        tensors += [p for group in torch_optimizer.param_groups for p in group["params"]]
        tensors += [v for s in torch_optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v)]  # fmt: skip
    return tensors


def _steps(args, name: str, n: int, steps: Steps, model, optimizer) -> Profile:
    data = iter(train_loader(args))
    profiler = MemoryProfiler(model)
    cuda = args.device == "cuda"
    seconds, peaks, after = [], [], []
    try:
        for step in range(steps.warmup + steps.measured):
            _, record, phases, _ = run_step(args, model, optimizer, data, profiler, step)
            seconds.append(sum(phases.values()))
            if cuda:  # absolute: the profiler reset the peak as the step began
                peaks.append(torch.cuda.max_memory_allocated() / MiB)
                after.append(record.after_forward_MiB)  # over the step's start, as Lightning's
            else:
                peaks.append((_state_bytes(model, optimizer) + record.saved_bytes) / MiB)
                after.append(record.saved_bytes / MiB)
    except torch.OutOfMemoryError:
        profiler.abort()  # the exception's frames held the step's tensors: freed by the caller
        return Profile(name, n, None)
    tokens = args.seq_length * args.micro_batch_size * args.num_microbatches
    timed = slice(steps.warmup, None)
    return Profile(
        name,
        n,
        max(peaks[timed]),
        tokens / statistics.median(seconds[timed]),
        max(after[timed]),
    )


def _state_bytes(model, optimizer) -> int:
    """The model and optimizer state's distinct storages, each counted once."""
    return distinct_bytes(_state_tensors(model, optimizer))


def recompute_of(args: argparse.Namespace) -> dict:
    """Megatron's recompute options as the run has them."""
    return {
        key: getattr(args, f"recompute_{key}") for key in ("granularity", "method", "num_layers")
    }


def _set_recompute(args: argparse.Namespace, n: int) -> None:
    """Megatron's block recompute of the first ``n`` layers (none for 0)."""
    recompute = ("full", "block", n) if n else (None, None, None)
    args.recompute_granularity, args.recompute_method, args.recompute_num_layers = recompute


def record(plan: Plan, profiles: list[Profile], args: argparse.Namespace, steps: Steps) -> dict:
    cuda = args.device == "cuda"
    return plan.to_dict() | {
        "memory": ALLOCATOR if cuda else ESTIMATE,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "micro_batch_size": args.micro_batch_size,
        "num_microbatches": args.num_microbatches,
        "global_batch_size": args.global_batch_size,  # None: the micro-batch was not planned
        "recompute": recompute_of(args),
        "steps": asdict(steps),
        "profiles": [asdict(p) for p in profiles],
    }
