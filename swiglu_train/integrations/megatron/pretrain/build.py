"""What a run is built from: process groups and seeds, the TransformerConfig, the GPTModel
(our layer spec, or Megatron's own MLP) under Megatron's DDP, and its optimizer."""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from swiglu_train.integrations.megatron import get_gpt_layer_spec
from swiglu_train.integrations.megatron.experts import router_runs_without_te
from swiglu_train.integrations.megatron.pretrain.args import AUTO, MEGATRON_MLP
from swiglu_train.integrations.megatron.pretrain.peers import patch_liger_swiglu

CPU_SHIMS_ENV = "SWIGLU_TRAIN_MEGATRON_CPU_SHIMS"  # set by tests/megatron_recipe_cpu.py


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
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
    )
    dp = parallel_state.get_data_parallel_world_size()
    if args.dp is not None and args.dp != dp:
        raise ValueError(f"--dp {args.dp} but WORLD_SIZE/(tp*pp) gives {dp}")
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def moe_fields(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of --num-experts (none for a dense model): Megatron's
    top-k router with its aux-loss load balancing."""
    if args.num_experts is None:
        return {}
    return {
        "num_moe_experts": args.num_experts,
        "moe_router_topk": args.moe_router_topk,
        # softmax over one chosen logit has no gradient: Megatron takes top-1 only pre-softmax
        "moe_router_pre_softmax": args.moe_router_topk == 1,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
        "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
        "expert_model_parallel_size": args.ep,
    }


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
        # Megatron-LM's default, for stock; Liger patches that fused path
        bias_activation_fusion=args.mlp_impl in ("stock", "liger"),
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
        **moe_fields(args),
    )


def auto_choices(model: torch.nn.Module) -> list[str]:
    """One line per distinct choice ``--mlp-impl auto`` made (routed and shared experts each
    choose on their own shard's sizes), saying what and why."""
    seen = {
        (type(m).__name__, m.impl, m.auto_reason): None
        for m in model.modules()
        if getattr(m, "auto_reason", None) is not None
    }
    return [f"--mlp-impl auto: {kind} run {impl}: {why}" for kind, impl, why in seen]


def build_model(args: argparse.Namespace, config: TransformerConfig) -> DistributedDataParallel:
    if args.mlp_impl == "liger":
        said = patch_liger_swiglu()
        if torch.distributed.get_rank() == 0:
            print(said)
    experts = {"num_experts": args.num_experts} if args.num_experts is not None else {}
    if args.mlp_impl in MEGATRON_MLP:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", **experts)
        if experts:
            router_runs_without_te()  # ours calls it when built; stock MoE needs it too
    else:
        spec = get_gpt_layer_spec(args.mlp_impl, saved_fp8=args.saved_fp8, **experts)
    model = GPTModel(
        config,
        spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    if args.mlp_impl == AUTO and torch.distributed.get_rank() == 0:
        for line in auto_choices(model):
            print(line)
    if args.device == "cuda":
        model = model.cuda()
    if config.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.device == "cuda"
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_training(args: argparse.Namespace):
    """(config, model, optimizer) of a run, wired as Megatron's schedule expects: what the
    training loop and each of the planner's points train."""
    config = transformer_config(args)
    model = build_model(args, config)
    optimizer = build_optimizer(args, config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return config, model, optimizer


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
