"""``pretrain --activation-checkpointing auto``: measure short training steps of the run's own
model on this device, and pick the MLP impl and the number of checkpointed blocks that fit
the memory budget at the highest tokens/s (the decision: ``swiglu_train.memory.plan``).

Each measured point is a few whole optimizer steps of the pretraining module at the run's
micro-batch, accumulation, sequence length and precision (Lightning Fabric's precision plugin,
as the Trainer's), on random tokens, in Lightning's order: the first micro-batch's forward,
zero_grad, backward; each further micro-batch's forward and backward, adding into the held
gradients; then gradient clipping and AdamW, once. A step of A micro-batches runs the first
and, when A > 1, one more (the other A - 2 are alike), each timed apart from the optimizer
step; its tokens/s is A micro-batches over first + (A - 1) x further + optimizer
(``step_tokens_per_s``). So the optimizer counts once per global batch, as it runs, at the
device time of at most two micro-batches per step whatever A is. The first ``warmup`` steps
(Triton compilation and autotuning, optimizer state allocation) are left out of both figures.

Memory, per step, on CUDA: the allocator's peak over the whole step (each micro-batch's
forward and backward peaks, from the memory profiler, the further one's with the accumulated
gradients held, and the optimizer step's), in absolute MiB, which is what the budget bounds.
On the CPU there are no allocator figures: the peak is estimated as the model state
(parameters, gradients, optimizer state: their storages, counted) plus the bytes saved for
backward (exact, from the profiler). That leaves out transient buffers, so a CPU plan is a
lower bound; a CPU run needs an explicit budget.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from itertools import pairwise

import torch
from lightning.fabric import Fabric

from swiglu_train.integrations.lightning.config import PretrainConfig
from swiglu_train.integrations.lightning.host_model import STOCK
from swiglu_train.integrations.lightning.module import PretrainModule
from swiglu_train.integrations.lightning.precision import resolve_precision
from swiglu_train.layers.registry import (
    PORTABLE_IMPLS,
    QUACK_IMPLS,
    check_saved_fp8,
    saved_fp8_labels,
)
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
    step_tokens_per_s,
)
from swiglu_train.memory.profiler import MemoryProfiler, MiB
from swiglu_train.memory.saved import distinct_bytes
from swiglu_train.ops.experts import IMPLS as EXPERTS_IMPLS

MODES = ("manual", "auto")


@dataclass(frozen=True)
class Steps:
    """How many steps each measured point runs, and how many of them are warm-up."""

    warmup: int = 1
    measured: int = 3

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.measured < 1:
            raise ValueError(f"need warmup >= 0 and measured >= 1 steps, got {self}")


def check_plan_settings(cfg: PretrainConfig, resuming: bool = False) -> None:
    """train.activation_checkpointing, memory_budget_gb and plan_impls, before any work."""
    t = cfg.train
    if t.global_batch_size is not None and not t.auto_micro_batch_size:
        raise ValueError("train.global_batch_size (--global-batch-size) is for "
                         "--micro-batch-size auto; with a fixed micro-batch set "
                         "train.accumulate_grad_batches")  # fmt: skip
    if t.auto_micro_batch_size:
        if t.activation_checkpointing != "auto":
            raise ValueError("--micro-batch-size auto is the planner's: it needs "
                             "--activation-checkpointing auto")  # fmt: skip
        micro_batches(t.global_batch_size)  # missing or not a whole count: named now
        if t.accumulate_grad_batches != 1:
            raise ValueError(f"--micro-batch-size auto sets train.accumulate_grad_batches to "
                             f"the global batch over the micro-batch it picks; leave it 1, not "
                             f"{t.accumulate_grad_batches}")  # fmt: skip
    if t.activation_checkpointing not in MODES:
        raise ValueError(f"train.activation_checkpointing (--activation-checkpointing) must be "
                         f"one of {MODES}, got {t.activation_checkpointing!r}")  # fmt: skip
    if t.memory_budget_gb is not None and not t.memory_budget_gb > 0:
        raise ValueError(f"train.memory_budget_gb (--memory-budget-gb) must be positive GiB, "
                         f"got {t.memory_budget_gb}")  # fmt: skip
    if t.activation_checkpointing != "auto":
        if t.plan_impls is not None or t.memory_budget_gb is not None:
            raise ValueError("train.plan_impls and train.memory_budget_gb (--plan-impls, "
                             "--memory-budget-gb) are the planner's: they need "
                             "--activation-checkpointing auto")  # fmt: skip
        return
    if cfg.model.mlp_impl == STOCK:
        raise ValueError("--activation-checkpointing auto picks among our impls, and --mlp-impl "
                         "stock keeps the host's own MLPs: pass --checkpoint-layers N "
                         "instead")  # fmt: skip
    if resuming:
        raise ValueError("--activation-checkpointing auto plans a new run; a resume keeps its "
                         "run's plan: pass the --mlp-impl and --checkpoint-layers it recorded "
                         "(the summary's plan)")  # fmt: skip
    if t.devices not in (1, "1"):
        raise ValueError(f"--activation-checkpointing auto measures one device; train.devices "
                         f"is {t.devices!r}: plan with --devices 1, then pass its --mlp-impl "
                         "and --checkpoint-layers to the multi-device run")  # fmt: skip
    if not torch.cuda.is_available() and t.memory_budget_gb is None:
        raise ValueError("--activation-checkpointing auto on the CPU needs --memory-budget-gb "
                         "(GiB): there is no device memory to default to, and the CPU peak is "
                         "an estimate (model state + saved-for-backward bytes)")  # fmt: skip
    candidates(cfg)  # an unknown or unrunnable impl, named now


def candidates(cfg: PretrainConfig) -> list[str]:
    """The impls the planner tries: train.plan_impls, else every exact impl that runs here
    (the quack ones with quack on an sm_90+ GPU); with model.saved_fp8, the impls that save in
    FP8 (drop_h_quack+fp8 with quack). In an MoE model, of those the routed experts' impls
    only: the others map to drop_h there (moe.py), so they would measure drop_h again."""
    from swiglu_train.ops.quack_mlp import quack_available

    names = cfg.train.plan_impls
    if names is None:
        if cfg.model.saved_fp8:
            found = saved_fp8_labels(quack_available())
        else:
            found = [*PORTABLE_IMPLS, *(sorted(QUACK_IMPLS) if quack_available() else [])]
        if cfg.model.num_experts:
            found = [name for name in found if split_candidate(name)[0] in EXPERTS_IMPLS]
        return found
    if not names:
        raise ValueError("train.plan_impls (--plan-impls) is empty: name at least one impl")
    for name in names:
        impl, fp8 = split_candidate(name)
        valid = [*PORTABLE_IMPLS, *sorted(QUACK_IMPLS), *saved_fp8_labels(quack=True)]
        if impl not in (*PORTABLE_IMPLS, *QUACK_IMPLS):
            raise ValueError(f"train.plan_impls (--plan-impls): unknown impl {name!r}; the "
                             f"planner tries concrete impls: {', '.join(valid)}")  # fmt: skip
        check_saved_fp8(impl, fp8)
        if impl in QUACK_IMPLS and not quack_available():
            raise ValueError(f"train.plan_impls (--plan-impls): {name} needs quack-kernels and "
                             "an sm_90+ GPU, which this machine lacks")  # fmt: skip
    return list(dict.fromkeys(names))


def measurer(
    cfg: PretrainConfig, steps: Steps = Steps(), log: Callable[[str], None] | None = None
) -> Callable[..., Profile]:
    """A ``measure(candidate, n, micro_batch_size=None)`` over the run's model, at the run's
    micro-batch and accumulation unless a micro-batch is given (then recorded in the profile,
    and accumulated up to train.global_batch_size): one model and optimizer per candidate,
    built on the device when first asked for and kept while the next points measure the same
    candidate (only ``checkpoint_layers`` and the micro-batch change)."""
    held: dict[str, tuple] = {}
    precision = resolve_precision(cfg.train.precision)
    cuda = _device().type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0

    def measure(name: str, n: int, micro_batch_size: int | None = None) -> Profile:
        if name not in held:
            freed = next(iter(held), None)
            held.clear()  # the previous candidate's model and optimizer go first, with its
            _free(_device())  # Fabric: one keeps every LightningModule it set up (_callbacks)
            if cuda and freed is not None:
                check_freed(before, f"{freed} model")
            fabric = Fabric(accelerator="auto", devices=1, precision=precision)
            held[name] = (fabric, *_build(fabric, cfg, name))
        fabric, module, optimizer = held[name]
        module.model.checkpoint_layers = n
        micro, accumulate = _batching(cfg, micro_batch_size)
        profile = _run_steps(fabric, cfg, module, optimizer, name, n, micro, accumulate, steps)
        profile = replace(profile, micro_batch_size=micro_batch_size)
        if log is not None:
            log(describe(profile, cfg.model.num_layers))
        return profile

    return measure


def _batching(cfg: PretrainConfig, micro_batch_size: int | None) -> tuple[int, int]:
    """(micro-batch, micro-batches per optimizer step) of a measured step."""
    if micro_batch_size is None:
        return cfg.data.micro_batch_size, cfg.train.accumulate_grad_batches
    if cfg.train.global_batch_size is None:
        raise ValueError(f"measuring at micro-batch {micro_batch_size} needs the global batch "
                         "it accumulates to: set train.global_batch_size")  # fmt: skip
    return micro_batch_size, accumulation(cfg.train.global_batch_size, micro_batch_size)


def describe(p: Profile, num_layers: int) -> str:
    peak = "out of memory" if p.peak_MiB is None else f"peak {p.peak_MiB:,.0f} MiB"
    rate = "" if p.tokens_per_s is None else f", {p.tokens_per_s:,.0f} tokens/s"
    blocks = f"{p.checkpoint_layers} of {num_layers} blocks checkpointed"
    micro = "" if p.micro_batch_size is None else f"micro-batch {p.micro_batch_size}, "
    a = p.accumulate_grad_batches
    accumulated = f"{a} micro-batches per optimizer step, " if a > 1 else ""
    return f"planner: {p.impl}, {micro}{accumulated}{blocks}: {peak}{rate}"


def plan_run(
    cfg: PretrainConfig, steps: Steps = Steps(), log: Callable[[str], None] | None = None
) -> dict:
    """Measure, choose, and set the chosen impl and checkpointed blocks on ``cfg.model``
    (with train.auto_micro_batch_size, the micro-batch and accumulation too). Returns the
    plan's record (for the summary and the W&B config); raises
    ``swiglu_train.memory.plan.NoPlanFits`` when nothing fits the budget."""
    device = _device()
    budget = default_budget_MiB(device, cfg.train.memory_budget_gb)
    num_layers = cfg.model.num_layers
    measure = measurer(cfg, steps, log)
    try:
        if cfg.train.auto_micro_batch_size:
            sizes = micro_batches(cfg.train.global_batch_size)
            profiles = search_micro_batches(candidates(cfg), num_layers, budget, sizes, measure)
        else:
            profiles = search(candidates(cfg), num_layers, budget, measure)
    finally:
        del measure  # its last model and Fabric hold each other: collected by _free's gc
        _free(device)
    plan = choose_plan(profiles, budget, num_layers)
    apply_plan(cfg, plan)
    return record(plan, profiles, cfg, device, steps)


def apply_plan(cfg: PretrainConfig, plan: Plan) -> None:
    impl, fp8 = split_candidate(plan.impl)
    cfg.model.mlp_impl, cfg.model.saved_fp8 = impl, fp8
    cfg.model.checkpoint_layers = plan.checkpoint_layers
    if impl != "save_factors":  # a chunk is save_factors' alone (check_mlp_chunk)
        cfg.model.mlp_chunk = None
    if plan.micro_batch_size is not None:
        cfg.data.micro_batch_size = plan.micro_batch_size
        cfg.train.accumulate_grad_batches = accumulation(
            cfg.train.global_batch_size, plan.micro_batch_size
        )


def record(
    plan: Plan, profiles: list[Profile], cfg: PretrainConfig, device: torch.device, steps: Steps
) -> dict:
    return plan.to_dict() | {
        "memory": ALLOCATOR if device.type == "cuda" else ESTIMATE,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "micro_batch_size": cfg.data.micro_batch_size,
        "accumulate_grad_batches": cfg.train.accumulate_grad_batches,
        "global_batch_size": cfg.train.global_batch_size,  # None: the micro-batch was not planned
        "seq_length": cfg.data.seq_length,
        "precision": resolve_precision(cfg.train.precision),
        "steps": asdict(steps),
        "profiles": [asdict(p) for p in profiles],
    }


def _build(fabric: Fabric, cfg: PretrainConfig, name: str):
    impl, fp8 = split_candidate(name)
    chunk = cfg.model.mlp_chunk if impl == "save_factors" else None
    model_cfg = replace(cfg.model, mlp_impl=impl, saved_fp8=fp8, mlp_chunk=chunk)
    with fabric.init_module():  # made on the device (and in bf16 under a -true precision)
        module = PretrainModule(model_cfg, cfg.optim, cfg.train.max_steps)
    optimizer = module.configure_optimizers()["optimizer"]
    module, optimizer = fabric.setup(module, optimizer)
    return module, optimizer


def _run_steps(
    fabric, cfg, module, optimizer, name: str, n: int, micro: int, accumulate: int, steps: Steps
) -> Profile:
    """``steps`` optimizer steps of ``accumulate`` micro-batches of ``micro`` sequences, each
    running its first micro-batch and at most one further one (module docstring); the
    measured steps' median parts, their tokens/s and the largest peak."""
    device = fabric.device
    rows = torch.randint(0, cfg.model.vocab_size, (micro, cfg.data.seq_length + 1),
                         device=device)  # fmt: skip
    profiler = MemoryProfiler(module, per_layer=False)
    parts, peaks, after = [], [], []
    loss, out_of_memory = None, False
    try:
        for i in range(steps.warmup + steps.measured):
            clock, records = _Clock(device), []
            for k in range(min(accumulate, 2)):
                profiler.begin(i)
                with fabric.autocast():
                    loss = module.loss(rows)
                if k == 0:  # Lightning's order: after the window's first forward
                    optimizer.zero_grad(set_to_none=True)
                profiler.forward_done()
                fabric.backward(loss)
                loss = None
                records.append(profiler.backward_done())
                clock.mark()
            if cfg.train.gradient_clip_val:
                fabric.clip_gradients(module, optimizer, max_norm=cfg.train.gradient_clip_val)
            optimizer.step()
            clock.mark()
            parts.append(clock.seconds())
            peaks.append(_peak_MiB(records, module, optimizer, device))
            after.append(max(_after_forward_MiB(r) for r in records))
    except torch.OutOfMemoryError:
        out_of_memory = True  # freed below: the exception's frames hold the step's tensors
    if out_of_memory:
        profiler.abort()
        loss = None
        optimizer.zero_grad(set_to_none=True)
        _free(device)
        return Profile(name, n, None, micro_batch_size=micro, accumulate_grad_batches=accumulate)
    measured = parts[steps.warmup :]
    first, *more, opt = (statistics.median(column) for column in zip(*measured, strict=True))
    further = more[0] if more else None
    tokens = micro * cfg.data.seq_length
    return Profile(
        name,
        n,
        max(peaks[steps.warmup :]),
        step_tokens_per_s(tokens, accumulate, first, further, opt),
        max(after[steps.warmup :]),
        micro,
        accumulate,
        first,
        further,
        opt,
    )


class _Clock:
    """Seconds between marks: CUDA events on the GPU, so the parts of a step are timed without
    a synchronization between them (training has none there); the host's clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in pairwise(self.marks)]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in pairwise(self.marks)]


def _peak_MiB(records: list, module, optimizer, device: torch.device) -> float:
    if device.type == "cuda":  # the profiler reset the peak at the last forward's end
        micro = max(r.allocated_MiB + r.peak_MiB for r in records)  # absolute, each micro-batch
        return max(micro, torch.cuda.max_memory_allocated(device) / MiB)  # + the optimizer's
    return (_state_bytes(module, optimizer) + max(r.saved_bytes for r in records)) / MiB


def _after_forward_MiB(memory) -> float:
    """The allocator's after-forward figure on CUDA; on the CPU, the saved-for-backward MiB."""
    if memory.after_forward_MiB is not None:
        return memory.after_forward_MiB
    return memory.saved_bytes / MiB


def _state_bytes(module, optimizer) -> int:
    """Parameters, gradients and optimizer state: distinct storages, counted once."""
    tensors = [p for p in module.parameters()]
    tensors += [p.grad for p in tensors if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return distinct_bytes(tensors)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
