"""Hugging Face transformers 5: the routed experts behind its experts interface.

MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts, OlmoeExperts, DeepseekV2Experts,
DeepseekV3NaiveMoe and ~20 more are one class copied under many names: ``gate_up_proj``
[E, 2F, D] holding [gate; up] rows per expert (``chunk(2)`` splits them), ``down_proj``
[E, D, F], ``act_fn`` SiLU, and ``forward(hidden_states [T, D], top_k_index [T, k],
top_k_weights [T, k])`` applying the router weight to each expert's output. Their decorator
``use_experts_implementation`` sends that call to ``ALL_EXPERTS_FUNCTIONS[
config._experts_implementation]`` (eager, grouped_mm, batched_mm), which compute the same sum.

They are patched here, not registered as an implementation there: transformers 5.3 refuses
any implementation name but its three in ``set_experts_implementation`` and
``from_pretrained``, one name would serve every impl and option, and ``patch`` must report
what it replaced and left. The replacement adopts ``gate_up_proj`` and ``down_proj`` as its
fc1 and fc2 (the same tensors: nothing copied, keys and values unchanged, an optimizer made
earlier still trains them), so ``from_pretrained`` and ``save_pretrained`` are untouched.

A module is recognized by what it computes, as the dense MLPs are: its eager forward compiles
to transformers' own (kept verbatim below), its gate is ``act_fn(gate) * up`` on [gate; up]
halves, ``act_fn`` computes SiLU, and the implementation in use is one of transformers' own.
gpt-oss's experts (a clamped ``swiglu_oai`` with alpha and limit on interleaved gate/up
columns of a transposed [E, D, 2F] weight, with biases) are left, with the reason; Llama-4's
experts (every expert on router-weighted tokens) are not this interface's, and their whole
MoE block is patched instead (``hf_llama4``).
"""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train.integrations.patch.experts import (
    ExpertsHost,
    PatchedExperts,
    gate_up_down_mismatch,
    module_mismatch,
)
from swiglu_train.integrations.patch.module import _like
from swiglu_train.integrations.patch.spec import _where, not_silu, same_code

LIBRARY = "transformers"
HF_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")
HOST_NAMES = {"fc1_weight": "gate_up_proj", "fc2_weight": "down_proj"}  # ours -> the host's
OUR_NAMES = {host: ours for ours, host in HOST_NAMES.items()}


# fmt: off
def _experts_forward(  # MixtralExperts.forward and its copies, verbatim (5.x)
    self,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[token_idx]
        gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)  # noqa: E501
        current_hidden_states = self.act_fn(gate) * up
        current_hidden_states = nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])  # noqa: E501
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))  # noqa: E501

    return final_hidden_states
# fmt: on


def _default_apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:  # integrations.moe
    gate, up = gate_up_out.chunk(2, dim=-1)  # (S, intermediate_dim)
    return self.act_fn(gate) * up  # (S, intermediate_dim)


class PatchedHFExperts(PatchedExperts):
    """transformers' routed experts on a ParExperts impl: fc1_weight is the host's
    ``gate_up_proj`` and fc2_weight its ``down_proj``, the same parameter objects, which
    ``experts.gate_up_proj`` still reads and the state_dict still names."""

    library = LIBRARY

    def forward(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """As transformers' grouped_mm experts: x cast to the weights' dtype (autocast may hand
        fp32 states to bf16 experts), y returned in x's."""
        y = super().forward(x.to(self.fc1_weight.dtype), expert_indices, expert_weights)
        return y.to(x.dtype)

    def host_state(self) -> dict[str, torch.Tensor]:
        return {host: getattr(self, ours).detach() for ours, host in HOST_NAMES.items()}

    def take_host_state(self, state_dict: dict, prefix: str, error_msgs: list[str]) -> None:
        for ours, host in HOST_NAMES.items():
            if prefix + host in state_dict:
                state_dict[prefix + ours] = _like(
                    state_dict.pop(prefix + host), getattr(self, ours)
                )

    def __getattr__(self, name: str):
        """``gate_up_proj``/``down_proj`` read as the parameters they are (``get_parameter``,
        code that reads the experts' weights by the host's names)."""
        return super().__getattr__(OUR_NAMES.get(name, name))


def fits(module: nn.Module) -> bool:
    """transformers' experts layout: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    params = module._parameters
    up, down = params.get("gate_up_proj"), params.get("down_proj")
    return up is not None and down is not None and up.dim() == 3 and down.dim() == 3


def mismatch(module: nn.Module) -> str | None:
    """Why experts that fit are not transformers' SwiGLU routed experts; None when they are."""
    why = _activation(module) or module_mismatch(module)
    if why:
        return why
    forward = type(module).forward
    if not same_code(forward, _experts_forward):
        return (
            f"its forward ({_where(forward)}) is not transformers' routed-experts forward "
            "(hidden_states, top_k_index, top_k_weights), which the experts interface runs"
        )
    if hasattr(forward, "__wrapped__"):  # use_experts_implementation: the config picks the code
        chosen = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if chosen not in HF_IMPLEMENTATIONS:
            return (
                f"its experts implementation {chosen!r} is not one of transformers' own "
                "(eager, grouped_mm, batched_mm), so what it computes is not known here"
            )
    return _weights(module)


def _activation(module: nn.Module) -> str | None:
    """Why the experts do not compute silu(gate) * up on [gate; up] halves of plain rows."""
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and not same_code(gate, _default_apply_gate):
        extras = [
            what
            for flag, what in (
                ("has_bias", "expert biases"),
                ("is_transposed", "a transposed [E, D, 2F] gate_up_proj"),
            )
            if getattr(module, flag, False)
        ]
        also = f"; it also has {' and '.join(extras)}" if extras else ""
        return (
            f"its gate ({_where(gate)}) is not silu(gate) * up on [gate; up] halves: another "
            f"activation (gpt-oss's clamped swiglu_oai is one){also}"
        )
    if not getattr(module, "has_gate", True):
        return "its experts are not gated (has_gate=False): not SwiGLU"
    if getattr(module, "has_bias", False):
        return "its experts have biases, which ParExperts does not"
    if getattr(module, "is_transposed", False):
        return "its gate_up_proj is stored transposed ([E, D, 2F])"
    act = getattr(module, "act_fn", None)
    return "it has no act_fn" if act is None else not_silu(act)


def _weights(module: nn.Module) -> str | None:
    why = gate_up_down_mismatch(module, transposed=False)
    if why:
        return why
    e = module.gate_up_proj.shape[0]
    experts = getattr(module, "num_experts", e)
    if experts != e:
        return f"its num_experts ({experts}) is not its weights' {e}: sharded for EP?"
    return None


def build(module: nn.Module, **options) -> PatchedHFExperts:
    """The replacement for ``module`` on meta (options checked): ParExperts' impl, saved_fp8
    and inplace; the router weight applies to each expert's output, as in the eager forward."""
    e, two_f, d = module.gate_up_proj.shape
    return PatchedHFExperts(
        type(module).__qualname__, e, d, two_f // 2, router_weights_on="output",
        dtype=module.gate_up_proj.dtype, **options,
    )  # fmt: skip


def install(patched: PatchedHFExperts, module: nn.Module) -> PatchedHFExperts:
    """``patched`` holding ``module``'s own parameters, in its training mode."""
    patched.fc1_weight = module.gate_up_proj
    patched.fc2_weight = module.down_proj
    return patched.train(module.training)


HOST = ExpertsHost(LIBRARY, fits, mismatch, build, install)
