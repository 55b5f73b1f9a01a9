"""The pretrain decoder as a Hugging Face ``LlamaForCausalLM`` directory (a Mixture-of-Experts
one as ``MixtralForCausalLM``), and back.

Our :class:`LlamaDecoder` computes HF Llama's function, and with ``num_experts`` HF Mixtral's,
so every weight maps one to one:

- ``embed`` / ``head`` are ``model.embed_tokens`` / ``lm_head`` (ours are never tied);
- ``attn.qkv`` rows are ``[q; k; v]`` with each head's rows together, as ``q_proj``,
  ``k_proj`` and ``v_proj`` stack them; RoPE rotates (first half, second half) pairs of each
  head with HF's default inverse frequencies, as HF's ``rotate_half`` does, so no row is
  permuted (only Meta's original interleaved checkpoints need that);
- ``attn_norm`` / ``mlp_norm`` / ``norm`` are ``input_layernorm`` /
  ``post_attention_layernorm`` / ``model.norm``, with the eps as ``rms_norm_eps``;
- a ParMLP's canonical fc1 ``[gate; up]`` is ``gate_proj`` / ``up_proj`` and fc2 is
  ``down_proj``; a packed fc1 is unpacked first, by the layout the checkpoint records;
- an MoE block's router is Mixtral's ``mlp.gate`` and its ParExperts' ``fc1_weight`` [E, 2F, D]
  and ``fc2_weight`` [E, D, F] are ``mlp.experts.gate_up_proj`` and ``down_proj`` as they are
  (routed experts are canonical in every impl). Mixtral routes as moe.py does: softmax in
  fp32, top k, renormalised; it always renormalises, so a model with ``moe_renormalize``
  off has no exact HF twin here (Qwen3-MoE and OLMoE, which may not, also normalise q and k)
  and is refused. ``save_pretrained`` writes transformers' per-expert Mixtral keys
  (``block_sparse_moe.experts.N.w1/w2/w3``), which transformers 4 and 5 both load.

What HF Llama and Mixtral can be and our decoder cannot (grouped-query attention, biases,
scaled RoPE, another activation, a head size of its own, attention dropout, sliding-window
attention, router jitter) is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import torch

from swiglu_train.extras import MissingExtra
from swiglu_train.files import atomic_directory
from swiglu_train.integrations.lightning.checkpoint_record import LAYOUT_KEY
from swiglu_train.integrations.lightning.config import TrainConfig
from swiglu_train.integrations.lightning.data import EOD
from swiglu_train.integrations.lightning.host_model import host_config, parse_source
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.module import OptimConfig, PretrainModule
from swiglu_train.layers.layout import CANONICAL
from swiglu_train.packing import from_hf, to_hf

PREFIX = "model."  # PretrainModule's attribute holding the decoder
HOST_PREFIX = PREFIX + "host."  # a --model run's: HostCausalLM.host, under the host's own keys
# Our decoder's keys (after ParMLP's are renamed gate/up/down_proj) -> HF's; per layer, the
# qkv rows split in three.
TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "head.weight": "lm_head.weight"}  # fmt: skip
ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.out.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
DENSE = {name: name for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight")}  # fmt: skip
MOE = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.fc1_weight": "mlp.experts.gate_up_proj",
    "mlp.experts.fc2_weight": "mlp.experts.down_proj",
}
QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def layer_names(cfg: ModelConfig) -> dict[str, str]:
    """A block's keys (not qkv) -> HF's: a ParMLP's or, in an MoE model, Mixtral's MoE."""
    return {**ATTENTION, **(MOE if cfg.num_experts else DENSE)}


def hf_class(cfg: ModelConfig):
    """The HF model class of our decoder: Mixtral's for an MoE model, else Llama's."""
    return getattr(_transformers(), MODEL_TYPES["mixtral" if cfg.num_experts else "llama"])


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise MissingExtra("Hugging Face export and import need transformers and safetensors",
                           "hf") from e  # fmt: skip
    return transformers


def model_config(ckpt: dict, where: str) -> ModelConfig:
    """The decoder's config a pretrain checkpoint was saved with (its saved init args)."""
    saved = ckpt.get("hyper_parameters", {}).get("model") if isinstance(ckpt, dict) else None
    if not isinstance(saved, dict) or "state_dict" not in ckpt:
        raise ValueError(
            f"{where} is not a pretrain checkpoint (no hyper_parameters.model beside its "
            "state_dict): the whole model is exported from what `swiglu-train pretrain` or "
            "import-hf writes"
        )
    return ModelConfig(**saved)


def hf_config(cfg: ModelConfig, dtype: torch.dtype):
    """The LlamaConfig of our decoder, or the MixtralConfig of an MoE one (intermediate_size is
    then each expert's F); eos is the recipe's end-of-document id."""
    transformers = _transformers()
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": EOD if cfg.vocab_size > EOD else None,
        "dtype": str(dtype).removeprefix("torch."),
        "architectures": [hf_class(cfg).__name__],
    }
    if not cfg.num_experts:
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    return transformers.MixtralConfig(
        **common,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


def to_hf_state(ckpt: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A pretrain checkpoint's weights under HF Llama's (Mixtral's) names, fc1 unpacked."""
    # Routed experts are canonical in every impl, and named as Mixtral's below; a ParMLP's fc1
    # is made canonical by the recorded layout, then gate/up/down_proj.
    mlp_renamed = dict(ckpt["state_dict"]) if cfg.num_experts else to_hf(ckpt)
    ours = {k.removeprefix(PREFIX): v for k, v in mlp_renamed.items() if k.startswith(PREFIX)}
    stray = sorted(set(mlp_renamed) - {PREFIX + k for k in ours})
    hf = {TOP[k]: ours.pop(k) for k in list(ours) if k in TOP}
    for i in range(cfg.num_layers):
        ours_at, hf_at = f"layers.{i}.", f"model.layers.{i}."
        for name, hf_name in layer_names(cfg).items():
            if ours_at + name in ours:
                hf[hf_at + hf_name] = ours.pop(ours_at + name)
        if ours_at + "attn.qkv.weight" in ours:
            qkv = ours.pop(ours_at + "attn.qkv.weight").chunk(3)
            hf.update({hf_at + n: w.contiguous() for n, w in zip(QKV, qkv, strict=True)})
    stray += sorted(PREFIX + k for k in ours)
    if stray:  # a decoder of another structure: no HF name to give these
        raise ValueError(f"no {hf_class(cfg).__name__} name for {', '.join(stray[:5])}")
    return hf


def export_hf(ckpt: dict, out: Path, where: str) -> dict[str, Any]:
    """Write ``out`` (config.json, model.safetensors, generation_config.json) from a pretrain
    checkpoint, through transformers' own model: every weight is loaded strictly (by name and
    shape) into a ``LlamaForCausalLM`` (``MixtralForCausalLM``) before ``save_pretrained``
    writes it. Returns the config written, as a dict."""
    cfg = model_config(ckpt, where)
    if cfg.source is not None:
        return _export_host(ckpt, cfg.source, out, where)
    if cfg.num_experts and not cfg.moe_renormalize:
        raise ValueError(
            f"{where}: its MoE router does not renormalise the top-k weights "
            "(moe_renormalize false), and HF Mixtral always does: no HF model here computes it "
            "exactly (Qwen3-MoE and OLMoE, which need not, also normalise q and k)"
        )
    state = to_hf_state(ckpt, cfg)
    dtype = state["model.embed_tokens.weight"].dtype
    config = hf_config(cfg, dtype)
    cls = hf_class(cfg)
    with torch.device("meta"):  # no memory: load_state_dict(assign=True) brings the weights
        model = cls(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # a missing key or another shape than the config's
        raise ValueError(f"{where} does not fit HF {cls.__name__}: "
                         f"{' '.join(str(e).split())}") from e  # fmt: skip
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
    return config.to_dict()


def _export_host(ckpt: dict, source: str, out: Path, where: str) -> dict[str, Any]:
    """A ``--model hf:`` run's checkpoint: its weights are the host's own keys already (patched
    MLPs and experts present them so; stock ones are the host's), so transformers' model of the
    source's config takes them as they are, strictly."""
    kind, _ = parse_source(source)
    if kind != "hf":
        raise ValueError(f"{where} trained {source}: export-hf writes transformers models, and "
                         f"its {HOST_PREFIX}* weights are LitGPT's own keys")  # fmt: skip
    state = {k.removeprefix(HOST_PREFIX): v for k, v in ckpt["state_dict"].items()
             if k.startswith(HOST_PREFIX)}  # fmt: skip
    config = host_config(source)
    config.dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    with torch.device("meta"):  # as export_hf: load_state_dict(assign=True) brings the weights
        model = _transformers().AutoModelForCausalLM.from_config(config)
    config.architectures = [type(model).__name__]
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{where} does not fit {source}'s {type(model).__name__}: "
                         f"{' '.join(str(e).split())}") from e  # fmt: skip
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
    return config.to_dict()


def check_mappable(config: Any, where: str) -> None:
    """Refuse an HF config whose model our decoder cannot compute exactly, naming why."""
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        raise ValueError(f"{where} holds a {config.model_type!r} model; import-hf takes Llama "
                         "(model_type 'llama', LlamaForCausalLM) and Mixtral ('mixtral', "
                         "MixtralForCausalLM)")  # fmt: skip
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = config.rope_parameters or {}
    window, jitter = (
        getattr(config, "sliding_window", None),
        getattr(config, "router_jitter_noise", 0),
    )
    problems = [
        (kv != heads, f"grouped-query attention (num_key_value_heads {kv} < "
                      f"num_attention_heads {heads}); our attention has a K/V head per head"),
        (head_dim * heads != config.hidden_size,
         f"head_dim {head_dim} x {heads} heads != hidden_size {config.hidden_size}"),
        (getattr(config, "attention_bias", False), "attention biases (attention_bias true)"),
        (getattr(config, "mlp_bias", False), "MLP biases (mlp_bias true)"),
        (config.hidden_act != "silu", f"hidden_act {config.hidden_act!r} (SwiGLU needs silu)"),
        (rope.get("rope_type", "default") != "default",
         f"RoPE scaling {rope.get('rope_type')!r} (our RoPE is the default, unscaled)"),
        (config.attention_dropout, f"attention_dropout {config.attention_dropout}"),
        (window is not None, f"sliding-window attention (sliding_window {window})"),
        (jitter, f"router jitter (router_jitter_noise {jitter}); our router has none"),
    ]  # fmt: skip
    found = [why for bad, why in problems if bad]
    if found:
        raise ValueError(f"{where} cannot be our decoder exactly: {'; '.join(found)}")


def import_hf(source: Path, max_steps: int = TrainConfig.max_steps) -> tuple[dict, list[str]]:
    """A pretrain checkpoint (weights, config and fc1 layout; no optimizer or loop state) from
    an HF Llama or Mixtral directory, for ``pretrain --init-from`` and
    ``load_from_checkpoint``; and notes on what was adapted (tied embeddings copied into the
    head)."""
    transformers = _transformers()
    where = str(source)
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} is not a Hugging Face model directory: {e}") from e
    check_mappable(config, where)
    cls = getattr(transformers, MODEL_TYPES[config.model_type])
    model, info = cls.from_pretrained(source, dtype="auto", output_loading_info=True)
    tied = bool(config.tie_word_embeddings)
    missing = [k for k in info["missing_keys"] if not (tied and k == "lm_head.weight")]
    if missing or info["mismatched_keys"]:
        raise ValueError(f"{where}: its weights do not fill the model its config describes "
                         f"(missing {missing}, mismatched {info['mismatched_keys']})")  # fmt: skip
    cfg = ModelConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        max_seq_length=config.max_position_embeddings,
        rope_theta=float((config.rope_parameters or {}).get("rope_theta", 10000.0)),
        norm_eps=config.rms_norm_eps,
        mlp_impl="drop_h",  # canonical fc1; any impl's ParMLP loads it, packing on load
        **_moe_settings(config),
    )
    state = from_hf_state(model.state_dict(), cfg)
    with torch.device("meta"):  # strict by name and shape, without memory for a second copy
        module = PretrainModule(cfg, OptimConfig(), max_steps)
    module.load_state_dict(state, strict=True, assign=True)
    tie = "tie_word_embeddings: the head starts as a copy of the embedding and trains apart"
    notes = [tie] if tied else []
    ckpt = {
        "state_dict": state,
        "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__,
        LAYOUT_KEY: {
            "fc1_layout": CANONICAL.to_dict(),
            "mlp_impl": cfg.mlp_impl,
            "imported_from": str(source.resolve()),
        },
    }
    return ckpt, notes


def _moe_settings(config: Any) -> dict[str, Any]:
    """Our MoE settings for a Mixtral config (routing renormalised, as Mixtral's always is);
    none for Llama."""
    if config.model_type != "mixtral":
        return {}
    return {"num_experts": config.num_local_experts, "moe_top_k": config.num_experts_per_tok,
            "moe_renormalize": True, "moe_aux_loss_coef": config.router_aux_loss_coef}  # fmt: skip


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF Llama (Mixtral) weights under PretrainModule's names; gate/up/down_proj become a
    canonical ParMLP (fc1 = [gate; up]) through the packing tools' ``from_hf``; Mixtral's
    experts are ParExperts' weights as they are."""
    hf = dict(hf)
    if "lm_head.weight" not in hf:  # a tied head may be saved once, as the embedding
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    state = {PREFIX + ours: hf.pop(name) for ours, name in TOP.items()}
    state[PREFIX + "head.weight"] = state[PREFIX + "head.weight"].clone()  # untied if tied
    for i in range(cfg.num_layers):
        ours_at, hf_at = f"{PREFIX}layers.{i}.", f"model.layers.{i}."
        state.update({ours_at + n: hf.pop(hf_at + hf_n) for n, hf_n in layer_names(cfg).items()})
        state[ours_at + "attn.qkv.weight"] = torch.cat([hf.pop(hf_at + n) for n in QKV])
    if hf:
        raise ValueError(f"no place in our decoder for HF weights {sorted(hf)[:5]}")
    return state if cfg.num_experts else from_hf(state)
