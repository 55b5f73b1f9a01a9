"""The pretrain decoder's Mixture-of-Experts MLP: a router, top-k routing, the routed SwiGLU
experts (ParExperts) and a load-balancing loss.

The routing is Mixtral's (transformers' ``MixtralSparseMoeBlock``), so that a checkpoint
exports as a ``MixtralForCausalLM`` with the same logits (hf.py): a bias-free linear router,
softmax over the experts in fp32, the top k of them, rescaled to sum to 1 when
``moe_renormalize`` (Qwen3-MoE's and OLMoE's ``norm_topk_prob``), each weight applied to its
expert's output. No shared expert, no capacity limit: every token reaches its k experts.

The load-balancing loss is Switch Transformer's as Mixtral writes it, per MoE layer:
``E · Σ_e f_e · P_e``, with f_e the fraction of tokens that chose expert e among their top k
(so Σ_e f_e = k) and P_e the mean router probability of e over the tokens. It is k when the
routing is uniform and grows as tokens crowd onto few experts; its gradient reaches the router
through P (f counts choices). The decoder averages it over its MoE layers, and the training
loss adds ``moe_aux_loss_coef`` times that to the next-token loss.
"""

from __future__ import annotations

import torch
from torch import nn

from swiglu_train.layers.experts import ParExperts, experts_auto, resolve_experts_impl
from swiglu_train.layers.registry import check_impl_name


def experts_impl(mlp_impl: str, hidden_size: int, ffn_hidden_size: int) -> tuple[str, str | None]:
    """(the experts' impl for ``--mlp-impl``, why it is another one): the routed experts have
    normal, drop_h and drop_h_quack; save_factors (and its quack form) map to the drop_h impls,
    as ``patch()`` maps them, and auto to what ParExperts' auto picks for these sizes on the
    current device (``experts_auto``). An unknown name is refused, listing the valid ones."""
    check_impl_name(mlp_impl)
    impl, why = resolve_experts_impl(mlp_impl, None)
    if impl == "auto":
        return experts_auto(hidden_size, ffn_hidden_size, "output")
    return impl, why


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """E · Σ_e f_e · P_e (module docstring) of router probabilities ``probs`` [..., E] and the
    top-k choices ``indices`` [..., k] of the same tokens; an fp32 scalar."""
    num_experts = probs.shape[-1]
    with torch.no_grad():  # f counts choices: no gradient
        chosen = torch.zeros(num_experts, device=probs.device, dtype=torch.float32)
        chosen.index_add_(0, indices.reshape(-1), torch.ones(indices.numel(), device=probs.device))
        fraction = chosen / max(1, probs[..., 0].numel())
    mean_prob = probs.reshape(-1, num_experts).float().mean(0)
    return num_experts * torch.dot(fraction, mean_prob)


class MoE(nn.Module):
    """Router and routed experts in one block's MLP slot: ``y, aux = moe(x)``."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        mlp_impl: str,
        saved_fp8: bool,
    ) -> None:
        super().__init__()
        check_impl_name(mlp_impl)
        impl, self.impl_note = resolve_experts_impl(mlp_impl, None)  # auto: ParExperts says why
        self.top_k, self.renormalize = top_k, renormalize
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = ParExperts(
            num_experts, hidden_size, ffn_hidden_size, impl=impl, saved_fp8=saved_fp8
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y [..., D], the load-balancing loss of these tokens)."""
        device = x.device.type
        if torch.is_autocast_enabled(device):  # one copy in autocast's dtype, which the router
            x = x.to(torch.get_autocast_dtype(device))  # and the experts then save alike
        probs = self.router(x).float().softmax(-1)
        weights, indices = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        # First: a checkpointed block's recompute stops at its last save, the experts' own
        aux = load_balancing_loss(probs, indices)
        return self.experts(x, indices, weights), aux

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, renormalize={self.renormalize}"
