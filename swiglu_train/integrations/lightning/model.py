"""A Llama-style decoder whose MLPs are ParMLPs, or with ``num_experts`` routed experts
(moe.py, Mixtral's block): RMSNorm, RoPE, causal SDPA attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swiglu_train.integrations.lightning.block_checkpoint import CheckpointLayers
from swiglu_train.integrations.lightning.float8 import check_float8
from swiglu_train.integrations.lightning.moe import MoE, experts_impl
from swiglu_train.layers import ParMLP
from swiglu_train.layers.experts import ParExperts
from swiglu_train.layers.layout import CANONICAL, order
from swiglu_train.layers.registry import (
    AUTO,
    FIXED_CHUNKS,
    IMPL_CHOICES,
    PACKED_IMPLS,
    check_impl_name,
    check_saved_fp8,
    packed_chunk,
)
from swiglu_train.ops.fp8_saved import check_fp8_gpu


@dataclass
class ModelConfig:
    vocab_size: int = 320  # 256 bytes + end-of-document, padded to a multiple of 64
    hidden_size: int = 192
    ffn_hidden_size: int = 512
    num_layers: int = 2
    num_heads: int = 6
    max_seq_length: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    mlp_impl: str = "drop_h"  # or "auto": chosen per layer by the fitted cost model
    mlp_tokens_hint: int | None = None  # tokens per micro-batch, for mlp_impl="auto"
    # fc1's pack chunk under save_factors (None: the largest power of two up to 128 dividing
    # ffn_hidden_size); see check_mlp_chunk for the impls that take one
    mlp_chunk: int | None = None
    # drop_h's saved preactivation in FP8 (swiglu_train.ops.fp8_saved); weights are unchanged
    saved_fp8: bool = False
    # "tensorwise" or "rowwise": the linears train in FP8 through torchao's Float8Linear, the lm
    # head aside (float8.py); with mlp_impl drop_h (its own FP8 GEMMs) or normal (torchao's)
    float8: str | None = None
    # torch.compile each transformer block (nn.Module.compile: keys and types unchanged). None:
    # on with float8, whose casts run as unfused eager kernels otherwise (2.4-3.8x the bf16
    # step on the H100, benchmarks/results/fp8/fp8_training_grid_h100.md), off without
    compile_blocks: bool | None = None
    # "hf:PATH/config.json" or "litgpt:NAME" (--model): train that architecture instead, its
    # MLPs patched to mlp_impl (integrations/lightning/host_model.py), or left as the host
    # built them with mlp_impl "stock"; the sizes above are then read from its config
    source: str | None = None
    # With mlp_impl "stock" and an HF MoE source: transformers' experts implementation (eager,
    # grouped_mm, batched_mm); None: transformers' default (grouped_mm where it can)
    experts_implementation: str | None = None
    # activation checkpointing of the first N transformer blocks (Megatron's
    # --recompute-num-layers with --recompute-method block): each keeps only its input for
    # backward and runs its forward again there
    checkpoint_layers: int = 0
    # Mixture of experts (moe.py): with num_experts > 0 each block's MLP is a router over that
    # many routed SwiGLU experts of ffn_hidden_size each, moe_top_k of them per token, run by
    # ParExperts in mlp_impl (save_factors maps to drop_h, as patch() maps it; auto to
    # ParExperts' auto: drop_h_quack where it runs, else drop_h)
    num_experts: int = 0
    moe_top_k: int = 2
    moe_renormalize: bool = True  # rescale each token's top-k weights to sum to 1 (Mixtral)
    moe_aux_loss_coef: float = 0.01  # the load-balancing loss's weight in the training loss

    def __post_init__(self) -> None:
        if self.source is not None:
            from swiglu_train.integrations.lightning.host_model import host_shape

            for key, value in vars(host_shape(self.source)).items():
                setattr(self, key, value)
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be at least 1, got {self.num_heads}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("the head dimension must be even for RoPE")
        check_stock(self)
        check_moe(self)
        check_mlp_chunk(self)
        check_model_saved_fp8(self)
        check_float8(self.float8, self.mlp_impl, self.num_experts)
        check_checkpoint_layers(self)


def compiles_blocks(cfg: ModelConfig) -> bool:
    """Whether the recipe torch.compiles each block: as asked, else exactly when --float8."""
    return cfg.float8 is not None if cfg.compile_blocks is None else cfg.compile_blocks


def check_stock(cfg: ModelConfig) -> None:
    """mlp_impl "stock" and experts_implementation against the model they would apply to
    (host_model.check_host_impl)."""
    from swiglu_train.integrations.lightning.host_model import check_host_impl

    check_host_impl(cfg.source, cfg.mlp_impl, cfg.experts_implementation, cfg.num_experts,
                    cfg.saved_fp8, cfg.mlp_chunk)  # fmt: skip


def check_impl(cfg: ModelConfig) -> None:
    """model.mlp_impl: one of ours (an unknown name is refused, listing them), or stock."""
    from swiglu_train.integrations.lightning.host_model import STOCK

    if cfg.mlp_impl != STOCK:
        check_impl_name(cfg.mlp_impl)
    check_stock(cfg)


def check_moe(cfg: ModelConfig) -> None:
    """num_experts, moe_top_k and moe_aux_loss_coef as numbers a router can take; no fc1 pack
    chunk for routed experts, which every impl keeps canonical."""
    e, k, coef = cfg.num_experts, cfg.moe_top_k, cfg.moe_aux_loss_coef
    if isinstance(e, bool) or not isinstance(e, int) or e < 0:
        raise ValueError(
            f"model.num_experts must be 0 (dense MLPs) or a count of experts, got {e!r}"
        )
    if e == 0:
        return
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e:
        raise ValueError(f"model.moe_top_k must be from 1 to num_experts={e}, got {k!r}")
    if not coef >= 0:
        raise ValueError(f"model.moe_aux_loss_coef must be at least 0, got {coef!r}")
    if cfg.mlp_chunk is not None:
        raise ValueError(
            f"model.mlp_chunk={cfg.mlp_chunk!r} (--mlp-chunk) packs a dense fc1, but this model's "
            f"MLPs are {e} routed experts, whose fc1 every impl keeps canonical: leave it unset"
        )


def runs_impl(cfg: ModelConfig) -> str:
    """The impl the model's MLPs run: the experts' for --mlp-impl in an MoE model."""
    if cfg.num_experts and cfg.source is None:
        return experts_impl(cfg.mlp_impl, cfg.hidden_size, cfg.ffn_hidden_size)[0]
    return cfg.mlp_impl


def check_checkpoint_layers(cfg: ModelConfig) -> None:
    """model.checkpoint_layers: an integer number of blocks from 0 to num_layers (a --model
    host's own, read from its config)."""
    n, where = cfg.checkpoint_layers, f"model.checkpoint_layers={cfg.checkpoint_layers!r}"
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= cfg.num_layers:
        raise ValueError(
            f"{where} (--checkpoint-layers) must be an integer from 0 to "
            f"num_layers={cfg.num_layers} (blocks)"
        )


def check_model_saved_fp8(cfg: ModelConfig, gpu: int | None = None) -> None:
    """model.saved_fp8 against the impl, and against CUDA device ``gpu`` where the run trains on
    one, in the config's words (ParMLP's say the same later, at the first forward)."""
    try:
        check_saved_fp8(runs_impl(cfg), cfg.saved_fp8)
        if cfg.saved_fp8 and gpu is not None:
            check_fp8_gpu(gpu)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.saved_fp8 (--saved-fp8): {e}") from None


def check_mlp_chunk(cfg: ModelConfig) -> None:
    """Refuse a chunk the model would not pack by, naming why (ParMLP would ignore it or fail
    later with its own words, not the config's).

    ``save_factors`` takes any chunk dividing ffn_hidden_size; ``auto`` too (it applies where
    auto picks save_factors). An impl with a layout of its own takes only the chunk it uses
    anyway: ``save_factors_quack`` 1 (quack's pair order), canonical impls none at all. An
    unknown impl is left to check_impl_name, which lists the valid ones.
    """
    chunk, impl, ffn = cfg.mlp_chunk, cfg.mlp_impl, cfg.ffn_hidden_size
    if chunk is None or impl not in IMPL_CHOICES:
        return
    where = f"model.mlp_chunk={chunk!r} (--mlp-chunk)"
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise ValueError(f"{where} must be a positive integer (rows)")
    if impl != AUTO and impl not in PACKED_IMPLS:
        raise ValueError(
            f"{where} packs fc1, but mlp_impl {impl!r} keeps fc1 canonical (unpacked): leave "
            "mlp_chunk unset, or pick an impl that packs (save_factors)"
        )
    fixed = FIXED_CHUNKS.get(impl)
    if fixed is not None and chunk != fixed:
        raise ValueError(
            f"{where}: mlp_impl {impl!r} always packs fc1 with chunk {fixed}; leave mlp_chunk "
            f"unset, or use save_factors for chunk {chunk}"
        )
    if fixed is None:
        try:
            packed_chunk("save_factors", chunk, ffn, size_name="ffn_hidden_size")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [seq, head_dim / 2] for rotary position embeddings."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of x [B, H, S, Dh], as in Llama."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """Attention, then a ParMLP, or an MoE (router and experts) where cfg.num_experts > 0."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if cfg.num_experts:
            self.mlp = MoE(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.moe_top_k,
                           cfg.moe_renormalize, cfg.mlp_impl, cfg.saved_fp8)  # fmt: skip
            return
        self.mlp = ParMLP(
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            impl=cfg.mlp_impl,
            chunk=cfg.mlp_chunk,
            tokens_hint=cfg.mlp_tokens_hint,
            saved_fp8=cfg.saved_fp8,
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the block's output, its MoE load-balancing loss or None). The loss is returned, not
        kept on the module, so a checkpointed block's recompute in backward leaves no state."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.mlp_norm(x))
            return x + y, aux
        return x + self.mlp(self.mlp_norm(x)), None


class LlamaDecoder(CheckpointLayers, nn.Module):
    """Token ids [B, S] -> logits [B, S, vocab] (with ``with_aux_loss``, also the MoE blocks'
    mean load-balancing loss, None for a dense model); its first ``checkpoint_layers`` blocks
    run under activation checkpointing (block_checkpoint.py)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_length, cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(_init_weights)
        self.checkpoint_layers = cfg.checkpoint_layers

    def forward(
        self, tokens: torch.Tensor, with_aux_loss: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if tokens.shape[1] > self.cfg.max_seq_length:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds max_seq_length "
                f"{self.cfg.max_seq_length}"
            )
        x, losses = self.embed(tokens), []
        for layer in self.layers:
            x, aux = layer(x, self.rope_cos, self.rope_sin)
            if aux is not None:
                losses.append(aux)
        logits = self.head(self.norm(x))
        if not with_aux_loss:
            return logits
        return logits, torch.stack(losses).mean() if losses else None


def _init_weights(module: nn.Module) -> None:
    """GPT-2/Llama-style small normal init, so the initial loss sits near log(vocab).

    A packed ParMLP's fc1 is drawn as if canonical and then packed (``apply`` visits children
    first), so a seed gives every impl the same function, packed or not. Routed experts are
    drawn as their dense twin's linears are.
    """
    if isinstance(module, ParExperts):
        for weight in (module.fc1_weight, module.fc2_weight):
            nn.init.normal_(weight, std=0.02)
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    if isinstance(module, ParMLP) and module.fc1_layout.packed:
        index = order(module.fc1.out_features, CANONICAL, module.fc1_layout)
        with torch.no_grad():
            for p in (module.fc1.weight, module.fc1.bias):
                if p is not None:
                    p.copy_(p[index.to(p.device)])
