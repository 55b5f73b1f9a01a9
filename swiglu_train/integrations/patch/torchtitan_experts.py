"""torchtitan 0.3: the routed experts of its ``MoE``, patched at ``RoutedExperts``.

torchtitan's ``GroupedExperts`` receives tokens already permuted by expert and a count per
expert, not the top-k indices and weights ParExperts takes; the router's weights are applied
later, by the token dispatcher's ``combine`` (on each expert's output). The seam that sees
x, indices and weights is ``RoutedExperts.forward(x_BLD, topk_scores_BLK,
topk_expert_ids_BLK, num_local_tokens_per_expert_E)``: dispatch, experts, combine. It is
replaced whole by a PatchedRoutedExperts whose ``inner_experts`` is a ParExperts, so the
router, the load-balancing counters, the shared experts and the state_dict prefix
(``routed_experts.inner_experts.``) stay torchtitan's.

GroupedExperts keeps ``w1_EFD`` (gate) and ``w3_EFD`` (up) [E, F, D] apart and ``w2_EDF``
[E, D, F]. The patched experts own one fc1 [E, 2F, D] = [w1; w3] per expert, built once at
patch time so no step concatenates weights, and adopt ``w2_EDF`` itself as fc2. Their
state_dict presents ``w1_EFD``, ``w2_EDF``, ``w3_EFD`` in torchtitan's order (w1 and w3 as
views of fc1's halves), and a load joins them back, as torchtitan's own FusedGroupedExperts
does. GroupedExperts computes in bf16 whatever its weights' dtype and returns x's dtype; the
patched experts do the same (``compute_dtype``).

Only the stock classes are recognized, by class: a subclass (gpt-oss's clamped experts with
biases, MXFP8's quantized GEMMs, the fused-w13 override) or a token dispatcher that exchanges
tokens across expert-parallel ranks is left, with the reason. No torchtitan import is needed.
"""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train.integrations.patch.experts import (
    ExpertsHost,
    PatchedExperts,
    module_mismatch,
    weights_mismatch,
)
from swiglu_train.integrations.patch.module import _like
from swiglu_train.ops.experts import experts_mlp

LIBRARY = "torchtitan"
MOE_MODULE = "torchtitan.models.common.moe"
DISPATCHER_MODULE = "torchtitan.models.common.token_dispatcher"
HOST_ORDER = ("w1_EFD", "w2_EDF", "w3_EFD")


def _is(obj: object, module: str, qualname: str) -> bool:
    """Whether ``obj`` is an instance of exactly torchtitan's ``module.qualname`` (not a
    subclass: they change the activation, the GEMM or the exchange of tokens)."""
    cls = type(obj)
    return cls.__module__ == module and cls.__qualname__ == qualname


class PatchedGroupedExperts(PatchedExperts):
    """torchtitan's GroupedExperts on a ParExperts impl, with its keys; ``compute_dtype``
    (bf16, as torchtitan; None: the weights' dtype) is the dtype the experts run in."""

    library = LIBRARY
    compute_dtype: torch.dtype | None = torch.bfloat16

    def forward(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [..., D] in x's dtype, computed in ``compute_dtype`` (the module docstring)."""
        dtype = self.compute_dtype or self.fc1_weight.dtype
        d, k = x.shape[-1], expert_indices.shape[-1]
        y = experts_mlp(
            x.reshape(-1, d).to(dtype),
            expert_indices.reshape(-1, k),
            expert_weights.reshape(-1, k),
            self.fc1_weight.to(dtype),
            self.fc2_weight.to(dtype),
            impl=self.impl,
            saved_fp8=self.saved_fp8,
            weights_on=self.router_weights_on,
            inplace=self.inplace,
        )
        return y.view(x.shape).to(x.dtype)

    def host_state(self) -> dict[str, torch.Tensor]:
        fc1, f = self.fc1_weight.detach(), self.ffn_hidden_size
        return {"w1_EFD": fc1[:, :f], "w2_EDF": self.fc2_weight.detach(), "w3_EFD": fc1[:, f:]}

    def take_host_state(self, state_dict: dict, prefix: str, error_msgs: list[str]) -> None:
        w1, w3 = prefix + "w1_EFD", prefix + "w3_EFD"
        if (w1 in state_dict) != (w3 in state_dict):
            given, missing = (w1, w3) if w1 in state_dict else (w3, w1)
            error_msgs.append(f"{given} is given without {missing}: fc1 needs both")
        elif w1 in state_dict:
            gate, up = state_dict.pop(w1), state_dict.pop(w3)
            want = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
            bad = [(k, t) for k, t in ((w1, gate), (w3, up)) if tuple(t.shape) != want]
            if bad:
                key, t = bad[0]
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(t.shape)} "
                    f"from checkpoint, the shape in current model is {torch.Size(want)}."
                )
            else:
                fc1 = torch.cat([gate, up], dim=1)
                state_dict[prefix + "fc1_weight"] = _like(fc1, self.fc1_weight)
        if prefix + "w2_EDF" in state_dict:
            state_dict[prefix + "fc2_weight"] = _like(
                state_dict.pop(prefix + "w2_EDF"), self.fc2_weight
            )

    def __getattr__(self, name: str):
        """torchtitan's names read as its weights: ``w2_EDF`` is fc2 itself; ``w1_EFD`` and
        ``w3_EFD`` are views of fc1's halves (write through ``load_state_dict``)."""
        if name in ("w1_EFD", "w3_EFD"):
            return self.host_state()[name]
        return super().__getattr__("fc2_weight" if name == "w2_EDF" else name)


class PatchedRoutedExperts(nn.Module):
    """What takes ``RoutedExperts``' place: the same call, computed by ``inner_experts``."""

    def __init__(self, inner_experts: PatchedGroupedExperts) -> None:
        super().__init__()
        self.inner_experts = inner_experts

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """Σ_k score · expert(x) per token, as dispatch, GroupedExperts and combine give; the
        per-expert counts are recomputed from the indices, so they are not read."""
        return self.inner_experts(x_BLD, topk_expert_ids_BLK, topk_scores_BLK)


def fits(module: nn.Module) -> bool:
    """torchtitan's RoutedExperts (the MoE's ``routed_experts``)."""
    return _is(module, MOE_MODULE, "RoutedExperts")


def mismatch(module: nn.Module) -> str | None:
    """Why a RoutedExperts cannot be replaced; None when it can."""
    inner, dispatcher = module.inner_experts, module.token_dispatcher
    if not _is(inner, MOE_MODULE, "GroupedExperts"):
        return (
            f"its inner_experts is a {type(inner).__qualname__}, not torchtitan's "
            "GroupedExperts (another activation, weight layout or grouped GEMM)"
        )
    if not _is(dispatcher, DISPATCHER_MODULE, "LocalTokenDispatcher"):
        return (
            f"its token dispatcher ({type(dispatcher).__qualname__}) exchanges tokens across "
            "expert-parallel ranks: patch supports EP = 1 only"
        )
    for part in (module, inner):
        why = module_mismatch(part)
        if why:
            return why if part is module else f"its inner_experts: {why}"
    if "_grouped_mm" in vars(inner):
        return "its inner_experts' _grouped_mm was replaced (a low-precision GEMM)"
    if set(inner._parameters) != set(HOST_ORDER) or inner._buffers:
        return f"its inner_experts holds {', '.join(inner._parameters)}, not {HOST_ORDER}"
    if inner.w1_EFD.requires_grad != inner.w3_EFD.requires_grad:
        return "its w1_EFD and w3_EFD differ in requires_grad (they become one fc1)"
    return weights_mismatch({name: getattr(inner, name) for name in HOST_ORDER})


def build(module: nn.Module, **options) -> PatchedGroupedExperts:
    """The patched experts on meta (options checked); torchtitan applies the router's weight
    to each expert's output (``combine``)."""
    inner = module.inner_experts
    e, f, d = inner.w1_EFD.shape
    return PatchedGroupedExperts(
        "GroupedExperts", e, d, f, router_weights_on="output", dtype=inner.w1_EFD.dtype,
        **options,
    )  # fmt: skip


def install(patched: PatchedGroupedExperts, module: nn.Module) -> PatchedRoutedExperts:
    """The RoutedExperts' replacement: fc1 [w1; w3] copied once, fc2 the host's w2 itself."""
    inner = module.inner_experts
    w1 = inner.w1_EFD
    patched.fc1_weight = nn.Parameter(
        torch.cat([w1.detach(), inner.w3_EFD.detach()], dim=1), requires_grad=w1.requires_grad
    )
    patched.fc2_weight = inner.w2_EDF
    return PatchedRoutedExperts(patched).train(module.training)


HOST = ExpertsHost(LIBRARY, fits, mismatch, build, install)
