"""``pretrain --model hf:PATH`` / ``--model litgpt:NAME``: a Hugging Face or LitGPT causal LM,
built from its architecture alone (random init, nothing downloaded), with its SwiGLU MLPs
patched to ``mlp_impl`` by ``swiglu_train.patch``, trained by the same recipe.

Sources:
  ``hf:PATH``       a transformers ``config.json`` (or the directory holding it);
  ``litgpt:NAME``   a LitGPT named config (``litgpt.Config.from_name``), or the path of a
                    LitGPT ``model_config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swiglu_train.integrations.lightning.block_checkpoint import CheckpointLayers
from swiglu_train.integrations.patch import patch
from swiglu_train.layers import ParMLP

KINDS = ("hf", "litgpt")
MIN_VOCAB = 257  # the byte tokenizer's ids, end-of-document included


@dataclass(frozen=True)
class HostShape:
    """What the recipe's config records of a host model (and checks a resume against)."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    max_seq_length: int


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
    """Token ids [B, S] -> logits [B, S, vocab] of a patched host model. ``layers`` are its
    decoder blocks (each with its ``mlp``), as the recipe reads them of its own decoder, and
    its first ``checkpoint_layers`` of them run under activation checkpointing."""

    def __init__(self, host: nn.Module, kind: str) -> None:
        super().__init__()
        self.host, self.kind = host, kind

    @property
    def layers(self) -> nn.ModuleList:  # a property: registering it would duplicate its keys
        return self.host.model.layers if self.kind == "hf" else self.host.transformer.h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.kind == "hf":
            return self.host(input_ids=tokens, use_cache=False).logits
        return self.host(tokens)


def build_host_model(
    source: str, impl: str, chunk: int | None, tokens_hint: int | None, saved_fp8: bool = False
) -> HostCausalLM:
    """The host model of ``source``, randomly initialized, every MLP patched to ``impl`` (with
    ``saved_fp8``, drop_h's FP8-saved preactivation); a model with an MLP that patch leaves
    (GeGLU, GELU, MoE experts) is refused, since ``--mlp-impl`` would not apply to it."""
    kind, _ = parse_source(source)
    config = host_config(source)
    if kind == "hf":
        import transformers

        host = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    else:
        from litgpt import GPT

        host = GPT(config)
    report = patch(host, impl, tokens_hint=tokens_hint, chunk=chunk)
    if report.left or not report.replaced:
        raise ValueError(
            f"--model {source}: --mlp-impl {impl} would not apply to every MLP:\n{report}"
        )
    for module in host.modules():
        if isinstance(module, ParMLP):
            module.saved_fp8 = saved_fp8
    return HostCausalLM(host, kind)
