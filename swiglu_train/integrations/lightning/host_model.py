"""``pretrain --model hf:PATH`` / ``--model litgpt:NAME``: a Hugging Face or LitGPT causal LM,
built from its architecture alone (random init, nothing downloaded), with its SwiGLU MLPs and
routed experts (transformers 5's MoE models: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3)
patched to ``mlp_impl`` by ``swiglu_train.patch``, trained by the same recipe. An HF MoE
model's own load-balancing loss (``aux_loss``) joins the objective as the built-in MoE's does.

``mlp_impl="stock"`` leaves the host's own MLPs and experts in place (transformers' experts in
``experts_implementation``: eager, grouped_mm or batched_mm), so that the same model measures
the baseline our impls are compared with.

Sources:
  ``hf:PATH``       a transformers ``config.json`` (or the directory holding it), or a packaged
                    one by name (``hf:moe_1b``: configs/hf/, each a pretrain config's twin);
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
STOCK = "stock"  # mlp_impl: the host's own MLPs, unpatched
# What transformers 5 accepts as a model's experts_implementation (PreTrainedModel.
# get_correct_experts_implementation); None leaves its default, grouped_mm where the class
# supports it, else eager.
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
HF_CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "hf"  # package data (pyproject)
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

        return transformers.AutoConfig.from_pretrained(hf_config_path(ref, source))
    from litgpt import Config

    if ref.endswith((".yaml", ".yml")):
        if not Path(ref).is_file():
            raise FileNotFoundError(f"--model {source}: no LitGPT model config at {ref}")
        return Config.from_file(ref)
    try:
        return Config.from_name(ref)
    except ValueError as e:
        raise ValueError(f"--model {source}: {e}") from None


def hf_config_path(ref: str, source: str) -> Path:
    """The config.json (or its directory) ``hf:REF`` names: a path, else a packaged config's
    name; neither is refused, listing the packaged names."""
    path = Path(ref)
    if path.exists():
        return path
    packaged = HF_CONFIG_DIR / f"{ref}.json"
    if "/" not in ref and packaged.is_file():
        return packaged
    names = sorted(p.stem for p in HF_CONFIG_DIR.glob("*.json"))
    raise FileNotFoundError(
        f"--model {source}: no config.json at {path}, nor a packaged HF config of that name "
        f"(packaged: {', '.join(names)})"
    )


def hf_num_experts(config) -> int:
    """An HF config's count of routed experts; 0 for a dense model."""
    return next((getattr(config, k) for k in HF_EXPERTS if getattr(config, k, None)), 0)


def check_host_impl(
    source: str | None,
    mlp_impl: str,
    experts_implementation: str | None,
    num_experts: int,
    saved_fp8: bool,
    mlp_chunk: int | None,
) -> None:
    """``mlp_impl="stock"`` and ``experts_implementation`` against the model they apply to, in
    the config's words: stock needs a host model (the recipe's own decoder is built of our
    layers), and takes none of our impls' options; experts_implementation picks transformers'
    own experts, so it needs stock and an HF MoE model."""
    stock = mlp_impl == STOCK
    if stock and source is None:
        raise ValueError(
            "model.mlp_impl 'stock' (--mlp-impl stock) keeps a --model hf:/litgpt: host's own "
            "MLPs; the recipe's own decoder (--config) is built of ParMLP/ParExperts: pass "
            "--model, or an impl"
        )
    if stock and (saved_fp8 or mlp_chunk is not None):
        option = "model.saved_fp8 (--saved-fp8)" if saved_fp8 else "model.mlp_chunk (--mlp-chunk)"
        raise ValueError(f"{option} is an option of our impls; --mlp-impl stock keeps the host's "
                         "own MLPs, which take none: leave it unset")  # fmt: skip
    if experts_implementation is None:
        return
    where = f"model.experts_implementation={experts_implementation!r} (--experts-implementation)"
    if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(
            f"{where} is not one of transformers': {', '.join(EXPERTS_IMPLEMENTATIONS)}"
        )
    if not stock:
        raise ValueError(f"{where} picks transformers' own experts, which only --mlp-impl stock "
                         f"keeps; --mlp-impl {mlp_impl} replaces them")  # fmt: skip
    if source is None or parse_source(source)[0] != "hf" or not num_experts:
        raise ValueError(f"{where} applies to a transformers MoE model (--model hf:PATH with "
                         "routed experts); this model has none")  # fmt: skip


def host_shape(source: str) -> HostShape:
    """The host model's sizes, from its config alone (the model is not built)."""
    kind, _ = parse_source(source)
    c = host_config(source)
    if kind == "hf":
        shape = HostShape(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                          c.num_attention_heads, c.max_position_embeddings)  # fmt: skip
        experts = hf_num_experts(c)
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
    """Token ids [B, S] -> logits [B, S, vocab] of a host model, patched or stock (with
    ``with_aux_loss``, also an HF MoE model's load-balancing loss, else None). ``layers`` are
    its decoder blocks (each with its ``mlp``), as the recipe reads them of its own decoder,
    and its first ``checkpoint_layers`` of them run under activation checkpointing."""

    def __init__(self, host: nn.Module, kind: str) -> None:
        super().__init__()
        self.host, self.kind = host, kind
        # Its router logits give the aux loss, whoever runs the experts (ParExperts or stock).
        self.routed = kind == "hf" and hf_num_experts(host.config) > 0

    @property
    def experts_implementation(self) -> str | None:
        """transformers' experts implementation where its own experts run (stock), else None."""
        if not self.routed or any(isinstance(m, ParExperts) for m in self.host.modules()):
            return None
        return self.host.config._experts_implementation

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
    source: str,
    impl: str,
    chunk: int | None,
    tokens_hint: int | None,
    saved_fp8: bool = False,
    experts_implementation: str | None = None,
) -> HostCausalLM:
    """The host model of ``source``, randomly initialized, every MLP and every block of routed
    experts patched to ``impl`` (the experts to their nearest impl where they lack it; with
    ``saved_fp8``, drop_h's FP8-saved preactivation, dense and experts alike); a model with an
    MLP that patch leaves (GeGLU, GELU, gpt-oss's experts) is refused, since ``--mlp-impl``
    would not apply to it. ``impl="stock"`` leaves the host as built, its experts (an HF MoE
    model's) in ``experts_implementation`` (None: transformers' default)."""
    kind, _ = parse_source(source)
    config = host_config(source)
    if kind == "hf":
        import transformers

        options = {"attn_implementation": "sdpa"}
        if experts_implementation is not None:
            options["experts_implementation"] = experts_implementation
        try:
            host = transformers.AutoModelForCausalLM.from_config(config, **options)
        except ValueError as e:  # an experts implementation the model's class does not take
            raise ValueError(f"--model {source}: {' '.join(str(e).split())}") from None
    else:
        from litgpt import GPT

        host = GPT(config)
    if impl == STOCK:
        return HostCausalLM(host, kind)
    report = patch(host, impl, tokens_hint=tokens_hint, chunk=chunk, saved_fp8=saved_fp8)
    if report.left or not report.replaced:
        raise ValueError(
            f"--model {source}: --mlp-impl {impl} would not apply to every MLP:\n{report}"
        )
    return HostCausalLM(host, kind)


def stock_note(model: nn.Module) -> str | None:
    """What runs a stock HF MoE model's experts, for the run's log (None where ours do): a
    comparison must know that transformers' grouped_mm runs in the weights' dtype, so fp32
    under bf16-mixed (it casts the input to the weights, and torch's grouped_mm has no autocast
    rule), where ParExperts run in autocast's."""
    impl = getattr(model, "experts_implementation", None)
    if impl is None:
        return None
    note = f"stock: transformers' own, experts_implementation {impl}"
    if impl == "grouped_mm":
        note += " (its grouped GEMMs run in the weights' dtype: fp32 under bf16-mixed)"
    return note
