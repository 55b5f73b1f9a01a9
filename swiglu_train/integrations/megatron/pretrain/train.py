"""The training loop: Megatron's forward-backward schedule, per-step loss and tokens/s, the
memory profiler's figures to W&B (rank 0), checkpoints at ``--save-interval``, and the
``--summary-json`` record."""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

import torch
from megatron.core import parallel_state

from swiglu_train.compile_workers import release_compile_workers
from swiglu_train.files import write_json_atomic
from swiglu_train.gc_pauses import GcPauses, manual_gc
from swiglu_train.integrations.megatron.pretrain.args import parse_args
from swiglu_train.integrations.megatron.pretrain.build import build_training, initialize
from swiglu_train.integrations.megatron.pretrain.checkpoint import load, save
from swiglu_train.integrations.megatron.pretrain.data import train_loader
from swiglu_train.integrations.megatron.pretrain.plan import plan_run, recompute_of
from swiglu_train.integrations.megatron.pretrain.step import host_threads, run_step
from swiglu_train.integrations.megatron.pretrain.step_profile import step_profile, write_profile
from swiglu_train.memory import MemoryProfiler
from swiglu_train.memory.wandb_run import WandbMemoryLogger, init_run

SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "micro_batch_size")


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the loss of each step run (on the last pipeline stage)."""
    args = parse_args(argv)
    initialize(args)
    if args.activation_checkpointing == "auto":
        args.planned = plan_run(args)  # sets args.mlp_impl, saved_fp8 and the recompute
        if torch.distributed.get_rank() == 0:
            print(f"plan: {args.planned['why']}")
    elif args.plan is not None and torch.distributed.get_rank() == 0:
        fp8 = " with --saved-fp8" if args.saved_fp8 else ""
        print(f"--plan {args.plan}: {args.mlp_impl}{fp8}, {args.recompute_num_layers or 0} "
              f"blocks recomputed, micro-batch {args.micro_batch_size} x "
              f"{args.num_microbatches} per optimizer step")  # fmt: skip
    _, model, optimizer = build_training(args)
    start = load(args.load, model, optimizer) if args.load else 0

    rank0 = torch.distributed.get_rank() == 0
    logger = None
    if rank0:
        run = init_run(
            args.wandb_project, name=args.mlp_impl, config=vars(args), directory=args.output_dir
        )
        logger = WandbMemoryLogger(run)
    profiler = MemoryProfiler(model) if rank0 and args.pp == 1 else None
    data = iter(train_loader(args))
    for _ in range(start * args.num_microbatches):  # resume where the saved run stopped
        next(data)
    tokens_per_step = (
        args.seq_length
        * args.micro_batch_size
        * args.num_microbatches
        * parallel_state.get_data_parallel_world_size()
    )
    losses, rates, records, gc_ms, phases, hosts = [], [], [], [], [], []
    cuda = args.device == "cuda"
    with manual_gc(args.manual_gc), GcPauses() as pauses:
        for step in range(start, args.max_steps):
            pauses.take()
            with step_profile(rank0 and step == args.profile_step, cuda) as prof:
                stats, record, step_phases, host = run_step(
                    args, model, optimizer, data, profiler, step
                )
            gc_ms.append(pauses.take()[0] * 1e3)  # collections inside the timed step
            phases.append(step_phases)
            hosts.append(host)
            seconds = sum(step_phases.values())
            if prof is not None:
                about = {k: getattr(args, k) for k in ("mlp_impl", "tp", *SHAPE_ARGS)}
                write_profile(prof, args.profile_json, step, seconds, cuda, **about)
            if stats:  # the last pipeline stage
                losses.append(step_loss(stats))
                rates.append(tokens_per_step / seconds)
                if record is not None:
                    records.append(record)
                if parallel_state.get_tensor_model_parallel_rank() == 0 and (
                    parallel_state.get_data_parallel_rank() == 0  # a line per step, not per rank
                ):
                    print(f"step {step} loss {losses[-1]:.6f} {rates[-1]:.0f} tokens/s")
                if logger is not None and record is not None:
                    logger.log(record, {"loss": losses[-1], "tokens_per_s": rates[-1]})
            done = step + 1
            if done == start + max(args.warmup_steps, 1) and not args.keep_compile_workers:
                args.compile_workers_released = release_compile_workers()  # compiling is done
            if args.manual_gc_interval and done % args.manual_gc_interval == 0:
                gc.collect()  # between steps, outside the timed window
            if args.save and (
                done == args.max_steps or (args.save_interval and done % args.save_interval == 0)
            ):
                save(args.save, done, model, optimizer)
    if logger is not None:
        logger.run.finish()
    if args.summary_json and rank0 and losses:
        write_summary(args, losses, rates, records, gc_ms, phases, hosts, first_step=start)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return losses


def step_loss(stats: list[dict]) -> float:
    """The step's loss: each DP rank holds the loss of its own micro-batches, and the step's is
    their mean (equal token counts), as Megatron-LM logs it, so runs at any DP size compare."""
    loss = torch.stack([s["lm loss"] for s in stats]).mean()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size()


def write_summary(
    args: argparse.Namespace,
    losses: list,
    rates: list,
    records: list,
    gc_ms: list,
    phases: list,
    hosts: list,
    first_step: int,
) -> None:
    """Losses, median tokens/s past --warmup-steps (compile, autotune) and the profiler's
    memory figures, as the Lightning recipe's --summary-json writes them; plus the shape, so
    a comparison across TP sizes (benchmarks/compare_tp.py) can compute the analytic figures."""
    steady = rates[args.warmup_steps :] or rates
    last = records[-1] if records else None
    peaks = [r.peak_MiB for r in records if r.peak_MiB is not None]  # None off CUDA
    summary = {
        "mlp_impl": args.mlp_impl,
        "saved_fp8": args.saved_fp8,
        "recompute": recompute_of(args),
        "plan": args.plan,
        "planned": getattr(args, "planned", None),  # --activation-checkpointing auto's record
        "tp": args.tp,
        "dp": parallel_state.get_data_parallel_world_size(),
        "num_microbatches": args.num_microbatches,  # global batch: micro-batch x this x dp
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "cpu_init": args.device == "cpu" or args.cpu_init,  # one model at every TP size
        "steps": len(losses),
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "tokens_per_s": statistics.median(steady),
        "warmup_steps": len(rates) - len(steady),  # 0 when the run had no more steps
        "step_tokens_per_s": rates,  # every step's, warm-up included
        "manual_gc": args.manual_gc,
        # host time in Python's collector inside each step (a pause the GPU waits out)
        "step_gc_ms": gc_ms,
        "gc_ms_per_step": statistics.fmean(gc_ms[len(rates) - len(steady) :] or gc_ms),
        "step_phases_s": phases,  # the host's wall time per phase of each step (step.run_step)
        "step_schedule_host": hosts,  # what held each step's schedule (step.run_step)
        "host_threads": host_threads(),  # after the steps: what the CPU work ran on
        # torch.compile's worker processes ended after the warm-up (None: kept)
        "compile_workers_released": getattr(args, "compile_workers_released", None),
        "after_forward_MiB": last.after_forward_MiB if last else None,
        "peak_MiB": max(peaks) if peaks else None,
        "saved_MiB": last.saved_bytes / 2**20 if last else None,
        "mlp_saved_MiB": {k: v / 2**20 for k, v in last.impl_saved_bytes.items()} if last else None,
        "losses": {str(first_step + i): loss for i, loss in enumerate(losses)},
        "shape": {key: getattr(args, key) for key in SHAPE_ARGS},
    }
    write_json_atomic(Path(args.summary_json), summary)
