"""Pretrain a Megatron-core GPTModel whose MLPs run a swiglu-train impl.

    torchrun --nproc-per-node 8 recipes/pretrain_megatron.py --mlp-impl drop_h --tp 2

GPTModel with ``get_gpt_layer_spec(mlp_impl)``, bf16 through Float16Module, Megatron's DDP
and DistributedOptimizer, MockGPTDataset unless ``--data-path`` names indexed datasets,
dist-ckpt save/resume, and per-step memory (profiler, rank 0) plus loss and throughput logged
to W&B (offline without an API key). ``--mlp-impl stock`` runs Megatron's own MLP for A/B.

``--device cpu`` runs on gloo in fp32 for smoke tests, with torch's AdamW stepping on the
DDP grad buffers (Megatron's optimizers allocate on "cuda" unconditionally) and model-only
checkpoints. Megatron still calls a few CUDA-only functions there (its RNG tracker, buffer
allocation), which tests/megatron_support.py replaces; so ``--device cpu`` runs through
tests/megatron_recipe_cpu.py, which installs those shims first (launched directly, the recipe
says so and stops).

W&B gets memory, loss and throughput from global rank 0, so only with ``--pp 1`` (with
pipeline parallelism rank 0 holds neither the loss nor a bracketed forward/backward).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from swiglu_train.files import write_json_atomic
from swiglu_train.integrations.megatron import SUPPORTED_IMPLS, get_gpt_layer_spec
from swiglu_train.layers.registry import check_saved_fp8
from swiglu_train.memory import MemoryProfiler
from swiglu_train.memory.wandb_run import WandbMemoryLogger, init_run

STOCK = ("stock", "stock_eager")  # Megatron's MLP: the baseline our spec replaces
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "micro_batch_size")


CPU_SHIMS_ENV = "SWIGLU_TRAIN_MEGATRON_CPU_SHIMS"  # set by tests/megatron_recipe_cpu.py


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mlp-impl",
        default=None,
        choices=[*SUPPORTED_IMPLS, *STOCK],
        help="ours (default drop_h), or Megatron's own MLP: 'stock' with its fused "
        "(torch.compile'd) bias-SwiGLU, 'stock_eager' with bias_activation_fusion off",
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
        "--saved-fp8",
        action="store_true",
        help="drop_h only: keep the saved preactivation in FP8 (e4m3, a scale per 128 columns)",
    )
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
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", type=int, default=1)
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
    p.add_argument("--data-path", nargs="*", default=None, help="indexed dataset prefixes")
    p.add_argument("--save", default=None, help="root of the iter_NNNNNNN dist-ckpt folders")
    p.add_argument("--save-interval", type=int, default=0, help="0: only at the end")
    p.add_argument("--load", default=None, help="an iter_NNNNNNN folder to resume from")
    p.add_argument("--wandb-project", default="swiglu-train-megatron")
    p.add_argument("--output-dir", default="runs")
    p.add_argument("--summary-json", default=None, help="rank 0 writes losses, tokens/s, memory")
    args = p.parse_args(argv)
    if args.plan is not None:
        apply_plan(p, args)
    args.mlp_impl = args.mlp_impl or "drop_h"
    check_recompute(p, args)
    if args.warmup_steps < 0:
        p.error(f"--warmup-steps must be at least 0, got {args.warmup_steps}")
    if args.saved_fp8 and args.mlp_impl in STOCK:
        p.error("--saved-fp8 is ours: Megatron's own MLP saves its preactivation in bf16")
    if args.saved_fp8:
        try:
            check_saved_fp8(args.mlp_impl)
        except ValueError as e:
            p.error(f"--saved-fp8: {e}")
    return args


def apply_plan(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--plan: the planner's impl and checkpointed blocks, for a model of its depth. It was
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


def initialize(args: argparse.Namespace) -> None:
    smoke = "torchrun --nproc-per-node N tests/megatron_recipe_cpu.py --device cpu ..."
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda (the default), but torch sees no CUDA device; the CPU "
                         f"smoke mode runs as {smoke}")  # fmt: skip
    if args.device == "cpu" and not os.environ.get(CPU_SHIMS_ENV):
        raise SystemExit(f"--device cpu needs Megatron's CUDA-only calls (RNG tracker, buffers) "
                         f"replaced, which the test launcher does: {smoke}")  # fmt: skip
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group(backend)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    dp = parallel_state.get_data_parallel_world_size()
    if args.dp is not None and args.dp != dp:
        raise ValueError(f"--dp {args.dp} but WORLD_SIZE/(tp*pp) gives {dp}")
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    bf16 = args.device == "cuda"
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        sequence_parallel=args.sequence_parallel,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=args.mlp_impl == "stock",  # Megatron-LM's default, for stock
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=args.device == "cpu" or args.cpu_init,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )


def build_model(args: argparse.Namespace, config: TransformerConfig) -> DistributedDataParallel:
    if args.mlp_impl in STOCK:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    else:
        spec = get_gpt_layer_spec(args.mlp_impl, saved_fp8=args.saved_fp8)
    model = GPTModel(
        config,
        spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    if args.device == "cuda":
        model = model.cuda()
    if config.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.device == "cuda"
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


class MainGradAdamW:
    """CPU smoke runs only: torch AdamW on the grads Megatron's DDP reduced into main_grad."""

    def __init__(self, model: DistributedDataParallel, lr: float) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        for p in self.params:
            p.grad = p.main_grad
        self.optimizer.step()


def build_optimizer(args: argparse.Namespace, config: TransformerConfig, model):
    if args.device == "cpu":
        return MainGradAdamW(model, args.lr)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [model],
    )
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


def train_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=(args.data_path, None) if args.data_path else None,  # None: mock data
        split="1,0,0",
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,  # the local attention's default causal mask is CUDA-only
        tokenizer=NullTokenizer(args.vocab_size - 1),
    )
    dp = parallel_state.get_data_parallel_world_size()
    samples = args.max_steps * args.num_microbatches * args.micro_batch_size * dp
    dataset_type = GPTDataset if args.data_path else MockGPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        dataset_type, [samples, 0, 0], lambda: True, config
    ).build()
    sampler = torch.utils.data.DistributedSampler(
        train, num_replicas=dp, rank=parallel_state.get_data_parallel_rank(), shuffle=False
    )
    return torch.utils.data.DataLoader(train, batch_size=args.micro_batch_size, sampler=sampler)


def loss_func(loss_mask: torch.Tensor, on_first: list, output: torch.Tensor):
    """Mean token loss; the first call marks the end of the profiled forward."""
    if on_first:
        on_first.pop()()
    loss = (output.float() * loss_mask).sum() / loss_mask.sum()
    # A copy: Megatron divides the returned loss by the micro-batch count in place, which a
    # detached view would follow (the logged loss was loss / --num-microbatches).
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(device: torch.device | None, on_first: list, data_iterator, model):
    batch = {k: v.to(device) if device else v for k, v in next(data_iterator).items()}
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"].float(), on_first)


def checkpoint_state(model: DistributedDataParallel, optimizer, is_loading: bool = False) -> dict:
    """Model and optimizer sharded state; DDP adds no keys of its own.

    DistributedOptimizer state goes in model space through the model's ShardedTensorFactories
    ('fully_reshardable'): it reshards across TP/PP/DP, and a packed fc1 (save_factors) is
    written canonical. megatron-core 0.16's default format no longer saves, and the 'dp_*'
    formats write the flat buffers as they sit in memory, refused for a packed fc1. A fresh
    dict per call: Megatron adds its process groups to the metadata in place.
    """
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    state = {"model": model.module.sharded_state_dict(metadata=metadata)}
    if isinstance(optimizer, MegatronOptimizer):
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], is_loading, metadata=metadata
        )
    return state


def save(root: str, step: int, model, optimizer) -> None:
    """Write ``ROOT/iter_{step:07d}``, which ``--load`` takes to resume at ``step``."""
    directory = os.path.join(root, f"iter_{step:07d}")
    os.makedirs(directory, exist_ok=True)
    state = checkpoint_state(model, optimizer) | {"step": step}
    dist_checkpointing.save(state, directory)


@contextlib.contextmanager
def loadable(optimizer: MegatronOptimizer) -> Iterator[None]:
    """A fresh optimizer made able to load a checkpoint where Megatron runs torch's Adam (no
    Apex or TE, as on our machines). Three megatron-core 0.16 gaps, met resuming on the H200:
    - DistributedOptimizer.state_dict reads one common 'step' off the param states, which a
      fresh Adam lacks: it gets zero moments and step 0 (what a fresh Adam starts from; the
      load overwrites both);
    - its fully-reshardable param load copies every per-param state key from the checkpoint,
      'step' included, which that format keeps per group: the per-param steps step aside
      while it runs and come back after (already set from the checkpoint's group step);
    - it hands every param the same 'step' tensor, which torch's Adam then bumps once per param
      per step (bias correction as if at step 3 + n_params, a 0.7 % loss jump on the H200):
      each param gets its own copy after the load.
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.init_state_fn is None:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for state in opt.optimizer.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
        load_params = getattr(opt, "load_parameter_state_from_fully_reshardable", None)
        if load_params is not None:
            opt.load_parameter_state_from_fully_reshardable = _steps_aside(opt, load_params)
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:  # the instance attribute goes; the class's method serves again
            del opt.load_parameter_state_from_fully_reshardable
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def _steps_aside(opt: MegatronOptimizer, load_params: Callable[[dict], None]):
    def load_without_step(param_state: dict) -> None:
        state = opt.optimizer.state
        steps = {p: s.pop("step") for p, s in state.items() if "step" in s}
        try:
            load_params(param_state)
        finally:
            for p, step in steps.items():
                state[p]["step"] = step

    return load_without_step


def load(directory: str, model, optimizer) -> int:
    megatron = isinstance(optimizer, MegatronOptimizer)
    with loadable(optimizer) if megatron else contextlib.nullcontext():
        state = dist_checkpointing.load(checkpoint_state(model, optimizer, True), directory)
        model.module.load_state_dict(state["model"])
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
    return dist_checkpointing.load_common_state_dict(directory)["step"]


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the loss of each step run (on the last pipeline stage)."""
    args = parse_args(argv)
    initialize(args)
    config = transformer_config(args)
    model = build_model(args, config)
    optimizer = build_optimizer(args, config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    start = load(args.load, model, optimizer) if args.load else 0

    rank0 = torch.distributed.get_rank() == 0
    logger = None
    if rank0:
        run = init_run(
            args.wandb_project, name=args.mlp_impl, config=vars(args), directory=args.output_dir
        )
        logger = WandbMemoryLogger(run)
    profiler = MemoryProfiler(model) if rank0 and args.pp == 1 else None
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    data = iter(train_loader(args))
    for _ in range(start * args.num_microbatches):  # resume where the saved run stopped
        next(data)
    forward_backward = get_forward_backward_func()
    tokens_per_step = (
        args.seq_length
        * args.micro_batch_size
        * args.num_microbatches
        * parallel_state.get_data_parallel_world_size()
    )
    losses, rates, records = [], [], []
    for step in range(start, args.max_steps):
        tic = time.perf_counter()
        on_first = []
        if profiler is not None:
            profiler.begin(step)
            on_first.append(profiler.forward_done)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        stats = forward_backward(
            forward_step_func=partial(forward_step, device, on_first),
            data_iterator=data,
            model=[model],
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        record = profiler.backward_done() if profiler is not None else None
        optimizer.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - tic
        if stats:  # the last pipeline stage
            # Each DP rank holds the loss of its own micro-batches; the step's is their mean
            # (equal token counts), as Megatron-LM logs it, so runs at any DP size compare.
            loss = torch.stack([s["lm loss"] for s in stats]).mean()
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss = loss.item() / parallel_state.get_data_parallel_world_size()
            losses.append(loss)
            rates.append(tokens_per_step / seconds)
            if record is not None:
                records.append(record)
            if parallel_state.get_tensor_model_parallel_rank() == 0 and (
                parallel_state.get_data_parallel_rank() == 0  # one line per step, not per DP rank
            ):
                print(f"step {step} loss {loss:.6f} {tokens_per_step / seconds:.0f} tokens/s")
            if logger is not None and record is not None:
                extra = {"loss": loss, "tokens_per_s": tokens_per_step / seconds}
                logger.log(record, extra)
        done = step + 1
        if args.save and (
            done == args.max_steps or (args.save_interval and done % args.save_interval == 0)
        ):
            save(args.save, done, model, optimizer)
    if logger is not None:
        logger.run.finish()
    if args.summary_json and rank0 and losses:
        write_summary(args, losses, rates, records, first_step=start)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return losses


def write_summary(
    args: argparse.Namespace, losses: list, rates: list, records: list, first_step: int
) -> None:
    """Losses, median tokens/s past --warmup-steps (compile, autotune) and the profiler's
    memory figures, as the Lightning recipe's --summary-json writes them; plus the shape, so
    a comparison across TP sizes (scripts/compare_tp.py) can compute the analytic figures."""
    steady = rates[args.warmup_steps :] or rates
    last = records[-1] if records else None
    peaks = [r.peak_MiB for r in records if r.peak_MiB is not None]  # None off CUDA
    summary = {
        "mlp_impl": args.mlp_impl,
        "saved_fp8": args.saved_fp8,
        "recompute": {
            key: getattr(args, f"recompute_{key}")
            for key in ("granularity", "method", "num_layers")
        },
        "plan": args.plan,
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
        "after_forward_MiB": last.after_forward_MiB if last else None,
        "peak_MiB": max(peaks) if peaks else None,
        "saved_MiB": last.saved_bytes / 2**20 if last else None,
        "mlp_saved_MiB": {k: v / 2**20 for k, v in last.impl_saved_bytes.items()} if last else None,
        "losses": {str(first_step + i): loss for i, loss in enumerate(losses)},
        "shape": {key: getattr(args, key) for key in SHAPE_ARGS},
    }
    write_json_atomic(Path(args.summary_json), summary)


if __name__ == "__main__":
    main()
