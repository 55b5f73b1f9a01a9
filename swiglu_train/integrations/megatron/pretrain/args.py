"""The recipe's command line: Megatron's recompute options checked in the combinations its
TransformerConfig takes, ``--plan``, a plan of swiglu-train's planner, and the MoE options
(``--num-experts``: every layer an MoE layer whose experts run ``--mlp-impl``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from swiglu_train.integrations.megatron import SUPPORTED_IMPLS
from swiglu_train.layers.registry import (
    SAVED_FP8_IMPLS,
    check_saved_fp8,
    saved_fp8_labels,
)
from swiglu_train.memory.budget import split_candidate
from swiglu_train.ops.experts import IMPLS as EXPERTS_IMPLS

AUTO = "auto"

DESCRIPTION = "Pretrain a Megatron-core GPTModel whose MLPs run a swiglu-train impl."
STOCK = ("stock", "stock_eager")  # Megatron's MLP: the baseline our spec replaces
PEERS = ("liger",)  # Megatron's MLP with a peer library's SwiGLU (pretrain/peers.py)
MEGATRON_MLP = (*STOCK, *PEERS)  # built from Megatron's own layer spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument(
        "--mlp-impl",
        default=None,
        choices=[*SUPPORTED_IMPLS, *MEGATRON_MLP, AUTO],
        help="ours (default drop_h), or Megatron's own MLP: 'stock' with its fused "
        "(torch.compile'd) bias-SwiGLU, 'stock_eager' with bias_activation_fusion off, "
        "'liger' with Liger-Kernel's SwiGLU patched into the fused path; with --num-experts, "
        "'auto' lets each MoE layer's experts choose drop_h or drop_h_quack",
    )
    p.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="Megatron's activation recompute: 'full' checkpoints whole transformer layers "
        "(with --recompute-method and --recompute-num-layers), 'selective' its core attention",
    )
    p.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="full recompute: 'block' checkpoints the first --recompute-num-layers layers, "
        "'uniform' every layer, in units of --recompute-num-layers",
    )
    p.add_argument("--recompute-num-layers", type=int, default=None)
    p.add_argument(
        "--plan",
        default=None,
        help="a plan of swiglu-train's planner (JSON: a pretrain --summary-json, or its 'plan'): "
        "its impl and checkpointed blocks as --mlp-impl and --recompute-method block",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=["auto"],
        default=None,
        help="'auto': measure short steps of this model per impl and recomputed layers, and "
        "train with the fastest that fits --memory-budget-gb (pretrain/plan.py)",
    )
    p.add_argument(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="the plan's budget in GiB (default: the GPU's memory less 5 %%)",
    )
    p.add_argument(
        "--plan-impls",
        type=lambda s: [i for i in s.split(",") if i],
        default=None,
        help="impls the plan tries, comma-separated (default: ours that run here; drop_h+fp8 "
        "is drop_h with --saved-fp8)",
    )
    p.add_argument(
        "--saved-fp8",
        action="store_true",
        help="drop_h only: keep the saved preactivation in FP8 (e4m3, a scale per 128 columns)",
    )
    p.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="MoE: every layer's MLP is a Megatron MoELayer of this many routed experts, run by "
        "--mlp-impl (ours: drop_h, normal, drop_h_quack; stock: Megatron's SequentialMLP)",
    )
    p.add_argument("--moe-router-topk", type=int, default=None, help="experts per token (2)")
    p.add_argument(
        "--moe-ffn-hidden-size", type=int, default=None, help="each expert's F (--ffn-hidden-size)"
    )
    p.add_argument(
        "--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default=None,
        help="Megatron's token dispatcher (alltoall)",
    )  # fmt: skip
    p.add_argument(
        "--moe-aux-loss-coeff", type=float, default=None,
        help="the router's load-balancing loss weight (1e-2)",
    )  # fmt: skip
    p.add_argument("--ep", type=int, default=None, help="expert parallel size (1)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="checked against WORLD_SIZE/(tp*pp)")
    p.add_argument("--sequence-parallel", action="store_true", help="needs Apex norms (local spec)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--ffn-hidden-size", type=int, default=2816)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=32000)
    # None until parsed: a --plan whose planner chose the micro-batch sets both, and refuses
    # either given by hand; "auto" leaves both to --activation-checkpointing auto
    p.add_argument(
        "--micro-batch-size",
        type=micro_batch_size,
        default=None,
        help="default 4; auto: the planner chooses it for --global-batch-size",
    )
    p.add_argument(
        "--num-microbatches", type=int, default=None, help="per optimizer step; default 1"
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="sequences per optimizer step on one rank, for --micro-batch-size auto",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=5,
        help="steps the summary's tokens/s leaves out (compilation, autotuning, allocation)",
    )
    p.add_argument(
        "--cpu-init",
        action="store_true",
        help="initialize full weights on the CPU from --seed, then shard them (Megatron's "
        "use_cpu_initialization), so runs at different TP sizes start from the same model",
    )
    p.add_argument(
        "--keep-compile-workers",
        action="store_true",
        help="keep torch.compile's worker pool after the warm-up steps (PyTorch keeps it 60 s "
        "after the last compile; by default the recipe releases it, as the pool starting up "
        "beside the run slowed every step: swiglu_train.compile_workers)",
    )
    p.add_argument(
        "--manual-gc",
        action="store_true",
        help="as Megatron-LM's: disable Python's automatic garbage collection, so no "
        "collection pauses a step; collect every --manual-gc-interval steps, between steps",
    )
    p.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="with --manual-gc: collect after every N steps (0: never during training)",
    )
    p.add_argument("--data-path", nargs="*", default=None, help="indexed dataset prefixes")
    p.add_argument(
        "--no-create-attention-mask-in-dataloader",
        dest="create_attention_mask_in_dataloader",
        action="store_false",
        help="as Megatron-LM's: no [s, s] causal mask per sample (CUDA only; the local "
        "attention then builds its own once), which spares each micro-batch the host's collate "
        "and pageable copy of the masks, on the step's critical path",
    )
    p.add_argument("--save", default=None, help="root of the iter_NNNNNNN dist-ckpt folders")
    p.add_argument("--save-interval", type=int, default=0, help="0: only at the end")
    p.add_argument("--load", default=None, help="an iter_NNNNNNN folder to resume from")
    p.add_argument("--wandb-project", default="swiglu-train-megatron")
    p.add_argument("--output-dir", default="runs")
    p.add_argument("--summary-json", default=None, help="rank 0 writes losses, tokens/s, memory")
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="profile this step (0-based) with torch.profiler; rank 0 writes --profile-json",
    )
    p.add_argument(
        "--profile-json", default=None, help="the profiled step's kernels: time and count each"
    )
    args = p.parse_args(argv)
    if args.activation_checkpointing == "auto":
        check_auto(p, args)
    if args.plan is not None:
        apply_plan(p, args)
    check_auto_micro_batch(p, args)
    args.mlp_impl = args.mlp_impl or "drop_h"
    if args.micro_batch_size != AUTO:  # else the planner sets both (plan.plan_run)
        args.micro_batch_size = 4 if args.micro_batch_size is None else args.micro_batch_size
        args.num_microbatches = 1 if args.num_microbatches is None else args.num_microbatches
    check_recompute(p, args)
    check_moe(p, args)
    if args.manual_gc_interval < 0 or (args.manual_gc_interval and not args.manual_gc):
        p.error(f"--manual-gc-interval {args.manual_gc_interval} needs --manual-gc and N >= 0")
    if args.device == "cpu" and not args.create_attention_mask_in_dataloader:
        p.error(
            "--no-create-attention-mask-in-dataloader needs --device cuda: without a mask "
            "Megatron's local attention builds its causal mask on the GPU"
        )
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be at least 0, got {args.warmup_steps}")
    if (args.profile_step is None) != (args.profile_json is None):
        p.error("--profile-step and --profile-json go together")
    if args.profile_step is not None and not 0 <= args.profile_step < args.max_steps:
        p.error(f"--profile-step {args.profile_step} is not a step of --max-steps {args.max_steps}")
    if args.saved_fp8 and args.mlp_impl in MEGATRON_MLP:
        p.error(f"--saved-fp8 is ours: Megatron's own MLP ({args.mlp_impl}) saves its "
                "preactivation in bf16")  # fmt: skip
    if args.saved_fp8:
        try:
            check_saved_fp8(args.mlp_impl)
        except ValueError as e:
            p.error(f"--saved-fp8: {e}")
    return args


def micro_batch_size(value: str) -> int | str:
    """--micro-batch-size: a positive count of sequences, or ``auto``."""
    if value == AUTO:
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"a positive number of sequences or auto, not {value!r}")
    return size


def apply_plan(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--plan: the planner's impl and checkpointed blocks, for a model of its depth, and its
    micro-batch and accumulation where it chose them (``--micro-batch-size auto``). It was
    measured on the Lightning Llama of swiglu-train's pretrain, whose memory is close to but
    not Megatron's: the run's own profiler figures say whether it fits here."""
    try:
        plan = json.loads(Path(args.plan).read_text())
    except (OSError, ValueError) as e:
        p.error(f"--plan {args.plan}: not a readable JSON file ({e})")
    plan = plan.get("plan", plan) if isinstance(plan, dict) else None
    if not isinstance(plan, dict) or not {"impl", "checkpoint_layers", "num_layers"} <= set(plan):
        p.error(
            f"--plan {args.plan}: no planner record (impl, checkpoint_layers, num_layers); "
            "pass what pretrain --activation-checkpointing auto --summary-json wrote"
        )
    taken = [
        f
        for f in ("mlp_impl", "recompute_granularity", "recompute_method", "recompute_num_layers")
        if getattr(args, f) is not None
    ]
    if taken or args.saved_fp8:
        flags = ", ".join("--" + f.replace("_", "-") for f in taken) or "--saved-fp8"
        p.error(f"--plan sets the impl and the recompute; drop {flags}")
    if plan["num_layers"] != args.num_layers:
        p.error(
            f"--plan {args.plan} was made for {plan['num_layers']} layers, not "
            f"--num-layers {args.num_layers}"
        )
    impl = plan["impl"]
    args.saved_fp8 = impl.endswith("+fp8")
    args.mlp_impl = impl.removesuffix("+fp8")
    if args.mlp_impl not in SUPPORTED_IMPLS:
        p.error(f"--plan {args.plan}: impl {impl!r} is not one this recipe runs")
    if plan["checkpoint_layers"]:
        args.recompute_granularity, args.recompute_method = "full", "block"
        args.recompute_num_layers = plan["checkpoint_layers"]
    if plan.get("global_batch_size") is not None:
        apply_planned_micro_batch(p, args, plan)


def apply_planned_micro_batch(p: argparse.ArgumentParser, args: argparse.Namespace, plan) -> None:
    """The micro-batch the planner chose for its global batch, and the accumulation to it, per
    data-parallel rank (the plan measured one GPU): a run on dp ranks steps dp times the
    plan's global batch. It was chosen for the plan's sequence length, so that must match."""
    given = [f for f in ("micro_batch_size", "num_microbatches") if getattr(args, f) is not None]
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        p.error(f"--plan {args.plan} sets the micro-batch ({plan['micro_batch_size']}) and the "
                f"accumulation to its global batch of {plan['global_batch_size']}; drop "
                f"{flags}")  # fmt: skip
    if plan.get("seq_length") not in (None, args.seq_length):
        p.error(f"--plan {args.plan} chose its micro-batch at --seq-length "
                f"{plan['seq_length']}, not {args.seq_length}")  # fmt: skip
    args.micro_batch_size = plan["micro_batch_size"]
    args.num_microbatches = plan["accumulate_grad_batches"]


def check_auto_micro_batch(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--micro-batch-size auto: the planner chooses it among the divisors of
    --global-batch-size, and the accumulation to it, so it needs both and takes neither
    --num-microbatches nor a global batch otherwise."""
    auto = args.micro_batch_size == AUTO
    if auto and args.activation_checkpointing != AUTO:
        p.error("--micro-batch-size auto is the planner's: add --activation-checkpointing auto")
    if auto and args.global_batch_size is None:
        p.error("--micro-batch-size auto needs --global-batch-size (sequences per step)")
    if auto and args.num_microbatches is not None:
        p.error("--micro-batch-size auto sets --num-microbatches to the global batch; drop it")
    if not auto and args.global_batch_size is not None:
        p.error("--global-batch-size goes with --micro-batch-size auto; otherwise the global "
                "batch is --micro-batch-size x --num-microbatches x dp")  # fmt: skip
    if args.global_batch_size is not None and args.global_batch_size < 1:
        p.error(f"--global-batch-size must be at least 1, got {args.global_batch_size}")


def check_auto(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--activation-checkpointing auto chooses the impl and the recompute itself, on one
    process, for a new run: what it cannot take is refused before any work."""
    for flag, given in (
        ("--plan", args.plan),
        ("--mlp-impl", args.mlp_impl),
        ("--recompute-granularity", args.recompute_granularity),
        ("--recompute-method", args.recompute_method),
        ("--recompute-num-layers", args.recompute_num_layers),
        ("--load", args.load),
    ):
        if given is not None:
            p.error(f"--activation-checkpointing auto chooses the impl and the recompute for "
                    f"a new run; drop {flag} (--plan-impls names the impls to try)")  # fmt: skip
    if (args.tp, args.pp) != (1, 1) or int(os.environ.get("WORLD_SIZE", 1)) != 1:
        p.error("--activation-checkpointing auto measures one process (--tp 1 --pp 1, one "
                "rank): plan on one GPU at the run's per-rank shape, then pass its --mlp-impl "
                "and recompute to the parallel run")  # fmt: skip
    if args.device == "cpu" and args.memory_budget_gb is None:
        p.error("--activation-checkpointing auto on the CPU needs --memory-budget-gb: the CPU "
                "peak is an estimate (model state + saved-for-backward bytes)")  # fmt: skip
    if args.memory_budget_gb is not None and not args.memory_budget_gb > 0:
        p.error(f"--memory-budget-gb must be positive, got {args.memory_budget_gb}")
    # an MoE model's MLPs are its routed experts, which run fewer impls (check_moe)
    runnable = [*EXPERTS_IMPLS, *STOCK] if args.num_experts else [*SUPPORTED_IMPLS, *MEGATRON_MLP]
    for name in args.plan_impls if args.plan_impls is not None else []:
        impl, fp8 = split_candidate(name)
        if impl not in runnable or (fp8 and impl not in SAVED_FP8_IMPLS):
            fp8_labels = ", ".join(saved_fp8_labels(quack=True))
            p.error(f"--plan-impls: {name!r} is not one this recipe runs ({', '.join(runnable)}"
                    f", {fp8_labels})")  # fmt: skip
    if args.plan_impls == []:
        p.error("--plan-impls is empty: name at least one impl")


def check_recompute(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Megatron's recompute options, in the combinations its TransformerConfig takes (its own
    check says less, and only once the model is being built)."""
    granularity, method, n = (
        args.recompute_granularity,
        args.recompute_method,
        args.recompute_num_layers,
    )
    if granularity is None and (method is not None or n is not None):
        p.error("--recompute-method and --recompute-num-layers need --recompute-granularity full")
    if granularity == "selective" and (method is not None or n is not None):
        p.error(
            "--recompute-granularity selective takes no --recompute-method or "
            "--recompute-num-layers (it recomputes the core attention of every layer)"
        )
    if granularity == "full" and (method is None or n is None):
        p.error(
            "--recompute-granularity full needs --recompute-method (block or uniform) and "
            "--recompute-num-layers"
        )
    per_stage = args.num_layers // args.pp
    if method == "block" and not 1 <= n <= per_stage:
        p.error(
            f"--recompute-method block: --recompute-num-layers must be from 1 to the "
            f"layers per pipeline stage, {per_stage}; got {n}"
        )
    if method == "uniform" and n < 1:
        p.error(f"--recompute-num-layers must be at least 1, got {n}")


MOE_OPTIONS = {  # the MoE flags' defaults, set once --num-experts makes the model MoE
    "moe_router_topk": 2,
    "moe_token_dispatcher_type": "alltoall",
    "moe_aux_loss_coeff": 1e-2,
    "ep": 1,
}


def check_moe(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The MoE options: together with --num-experts, with an impl that runs routed experts, in
    a layout Megatron's MoELayer takes; their defaults filled in."""
    given = [f for f in (*MOE_OPTIONS, "moe_ffn_hidden_size") if getattr(args, f) is not None]
    if args.num_experts is None:
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            p.error(f"{flags} configure MoE layers: add --num-experts")
        if args.mlp_impl == AUTO:
            p.error("--mlp-impl auto is the MoE experts' (add --num-experts): a dense MLP's "
                    "auto picks a layout per shape, while Megatron needs one layout before its "
                    "checkpoint is built; name an impl, or plan with --activation-checkpointing "
                    "auto")  # fmt: skip
        args.ep = 1
        return
    for name, default in MOE_OPTIONS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if args.num_experts < 1 or not 1 <= args.moe_router_topk <= args.num_experts:
        p.error(f"--num-experts {args.num_experts} and --moe-router-topk {args.moe_router_topk}: "
                "need 1 <= topk <= experts")  # fmt: skip
    if args.ep < 1 or args.num_experts % args.ep:
        p.error(f"--ep {args.ep} must divide --num-experts {args.num_experts}")
    runnable = (*EXPERTS_IMPLS, AUTO, *STOCK)
    if args.mlp_impl not in runnable:
        p.error(f"--num-experts: --mlp-impl {args.mlp_impl} does not run routed experts; choose "
                f"one of {', '.join(runnable)}")  # fmt: skip
    if args.activation_checkpointing == AUTO and args.ep != 1:
        p.error("--activation-checkpointing auto measures one process: plan with --ep 1 at the "
                "run's per-rank experts (--num-experts / ep), then pass its --mlp-impl and "
                "recompute to the expert-parallel run")  # fmt: skip
    if args.tp > 1 and not args.sequence_parallel:
        p.error("--num-experts with --tp > 1 needs --sequence-parallel (Megatron's MoELayer "
                "refuses to train with TP otherwise)")  # fmt: skip
