"""``pretrain --model hf:PATH`` / ``--model litgpt:NAME``: a Hugging Face or LitGPT causal LM,
built from its architecture alone (random init, nothing downloaded), with its SwiGLU MLPs and
routed experts (transformers 5's MoE models: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3)
patched to ``mlp_impl`` by ``swiglu_train.patch``, trained by the same recipe. An HF MoE
model's own load-balancing loss (``aux_loss``) joins the objective as the built-in MoE's does.

Sources:
  ``hf:PATH``       a transformers ``config.json`` (or the directory holding it);
  ``litgpt:NAME``   a LitGPT named config (``litgpt.Config.from_name``), or the path of a
                    LitGPT ``model_config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from swiglu_train.integrations.lightning.block_checkpoint import CheckpointLayers
from swiglu_train.integrations.patch import patch
from swiglu_train.layers.experts import ParExperts

KINDS = ("hf", "litgpt")
# How transformers' MoE configs name their count of routed experts (Mixtral; Qwen2/3-MoE and
# OLMoE; DeepSeek-V2/V3).
HF_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
MIN_VOCAB = 257  # the byte tokenizer's ids, end-of-document included


@dataclass(frozen=True)
class HostShape:
    """What the recipe's config records of a host model (and checks a resume against); an MoE
    model's ffn_hidden_size is its routed experts' (HF's moe_intermediate_size, where it has
    one)."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    max_seq_length: int
    num_experts: int = 0
    moe_top_k: int = 2


def parse_source(source: str) -> tuple[str, str]:
    """``"hf:PATH"`` -> ("hf", "PATH"); anything else is refused, naming the forms."""
    kind, sep, ref = source.partition(":")
    if not sep or kind not in KINDS or not ref:
        raise ValueError(
            f"model.source {source!r} (--model): use hf:PATH/config.json or litgpt:NAME "
            "(a LitGPT named config, or a model_config.yaml path)"
        )
    return kind, ref


def host_config(source: str):
    """The host library's config object for ``source`` (imports that library)."""
    kind, ref = parse_source(source)
    if kind == "hf":
        import transformers

        path = Path(ref)
        if not path.exists():
            raise FileNotFoundError(f"--model {source}: no config.json at {path}")
        return transformers.AutoConfig.from_pretrained(path)
    from litgpt import Config

    if ref.endswith((".yaml", ".yml")):
        if not Path(ref).is_file():
            raise FileNotFoundError(f"--model {source}: no LitGPT model config at {ref}")
        return Config.from_file(ref)
    try:
        return Config.from_name(ref)
    except ValueError as e:
        raise ValueError(f"--model {source}: {e}") from None


def host_shape(source: str) -> HostShape:
    """The host model's sizes, from its config alone (the model is not built)."""
    kind, _ = parse_source(source)
    c = host_config(source)
    if kind == "hf":
        shape = HostShape(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                          c.num_attention_heads, c.max_position_embeddings)  # fmt: skip
        experts = next((getattr(c, k) for k in HF_EXPERTS if getattr(c, k, None)), 0)
        if experts:
            ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
            shape = replace(shape, ffn_hidden_size=ffn, num_experts=experts,
                            moe_top_k=c.num_experts_per_tok)  # fmt: skip
    else:
        shape = HostShape(c.padded_vocab_size, c.n_embd, c.intermediate_size, c.n_layer,
                          c.n_head, c.block_size)  # fmt: skip
    if shape.vocab_size < MIN_VOCAB:
        raise ValueError(
            f"--model {source}: vocab_size {shape.vocab_size} is below the {MIN_VOCAB} ids of "
            "the byte-level data pretrain feeds it"
        )
    return shape


class HostCausalLM(CheckpointLayers, nn.Module):
    """Token ids [B, S] -> logits [B, S, vocab] of a patched host model (with
    ``with_aux_loss``, also an HF MoE model's load-balancing loss, else None). ``layers`` are
    its decoder blocks (each with its ``mlp``), as the recipe reads them of its own decoder,
    and its first ``checkpoint_layers`` of them run under activation checkpointing."""

    def __init__(self, host: nn.Module, kind: str) -> None:
        super().__init__()
        self.host, self.kind = host, kind
        self.routed = kind == "hf" and any(isinstance(m, ParExperts) for m in host.modules())

    @property
    def layers(self) -> nn.ModuleList:  # a property: registering it would duplicate its keys
        return self.host.model.layers if self.kind == "hf" else self.host.transformer.h

    def forward(
        self, tokens: torch.Tensor, with_aux_loss: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        aux = None
        if self.kind == "litgpt":
            logits = self.host(tokens)
        elif self.routed:  # the router's outputs, gathered by transformers into its aux_loss
            out = self.host(input_ids=tokens, use_cache=False, output_router_logits=True)
            logits, aux = out.logits, out.aux_loss
        else:
            logits = self.host(input_ids=tokens, use_cache=False).logits
        return (logits, aux) if with_aux_loss else logits


def build_host_model(
    source: str, impl: str, chunk: int | None, tokens_hint: int | None, saved_fp8: bool = False
) -> HostCausalLM:
    """The host model of ``source``, randomly initialized, every MLP and every block of routed
    experts patched to ``impl`` (the experts to their nearest impl where they lack it; with
    ``saved_fp8``, drop_h's FP8-saved preactivation, dense and experts alike); a model with an
    MLP that patch leaves (GeGLU, GELU, gpt-oss's experts) is refused, since ``--mlp-impl``
    would not apply to it."""
    kind, _ = parse_source(source)
    config = host_config(source)
    if kind == "hf":
        import transformers

        host = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        from litgpt import GPT

        host = GPT(config)
    report = patch(host, impl, tokens_hint=tokens_hint, chunk=chunk, saved_fp8=saved_fp8)
    if report.left or not report.replaced:
        raise ValueError(
            f"--model {source}: --mlp-impl {impl} would not apply to every MLP:\n{report}"
        )
    return HostCausalLM(host, kind)
