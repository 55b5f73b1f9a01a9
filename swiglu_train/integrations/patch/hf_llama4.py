"""Hugging Face transformers 5: Llama-4's MoE block (``Llama4TextMoe``), routed for real.

Llama-4's block runs every expert on every token: ``Llama4Router`` gives scores [T, E], the
sigmoid of the top-k logits and 0 elsewhere, and the block feeds ``hidden_states.repeat(E,
1) * scores`` to ``Llama4TextExperts`` (``gate_up_proj`` [E, D, 2F] with [gate | up] columns,
``down_proj`` [E, F, D], no biases, SiLU), E/k times the expert work and activation memory
needed. An expert fed 0 gives 0 (no biases, swiglu(0) = 0), and its output is quadratic in
its score near 0, so it contributes nothing to any gradient either: running only the top-k
experts on their score-scaled tokens (ParExperts' ``router_weights_on="input"``) is the same
function with the same gradients.

The block is replaced whole by :class:`PatchedLlama4Moe`: the router and the shared expert
are the host's modules, kept (the shared expert, a ``Llama4TextMLP``, is then patched as the
dense MLPs are); the experts become :class:`PatchedLlama4Experts`, whose fc1 and fc2 are the
host's weights transposed to ours, copied once at patch time. Their state_dict presents
``gate_up_proj`` and ``down_proj`` back in the host's layout (transposed views) and loads
them from it, so checkpoints keep the host's keys and values. The copies are new parameters:
build the optimizer after ``patch`` (one built before raises on its first step).

A block is recognized by what it computes: its forward, its experts' and its router's are
transformers' own (kept verbatim below), its experts' activation computes SiLU and its
shapes chain. Anything else is left, with the reason.
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
HOST_ORDER = ("gate_up_proj", "down_proj")


# fmt: off
def _moe_forward(self, hidden_states):  # Llama4TextMoe.forward, verbatim (5.x)
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)
    routed_in = hidden_states.repeat(router_scores.shape[1], 1)
    routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)
    routed_out = self.experts(routed_in)
    out = self.shared_expert(hidden_states)
    out.add_(routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0))
    return out, router_logits


def _experts_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # Llama4TextExperts
    """
    This should really not be run on a single machine, as we are reaching compute bound:
    - the inputs are expected to be "sorted" per expert already.
    - the weights are viewed with another dim, to match num_expert, 1, shape * num_tokens, shape

    Args:
        hidden_states (torch.Tensor): (batch_size * token_num, hidden_size)
        selected_experts (torch.Tensor): (batch_size * token_num, top_k)
        routing_weights (torch.Tensor): (batch_size * token_num, top_k)
    Returns:
        torch.Tensor
    """
    hidden_states = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate_up = torch.bmm(hidden_states, self.gate_up_proj)
    gate, up = gate_up.chunk(2, dim=-1)  # not supported for DTensors
    next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
    next_states = next_states.view(-1, self.hidden_size)
    return next_states


class _Router(nn.Linear):  # Llama4Router, its forward verbatim (5.x)
    def forward(self, hidden_states):
        router_logits = super().forward(hidden_states)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value)  # noqa: E501
        router_scores = torch.nn.functional.sigmoid(router_scores.float()).to(router_scores.dtype)
        return router_scores, router_logits
# fmt: on


class PatchedLlama4Experts(PatchedExperts):
    """``Llama4TextExperts`` on a ParExperts impl with the router's score on each expert's
    input: fc1_weight is ``gate_up_proj`` transposed ([E, 2F, D], [gate; up] rows), fc2_weight
    ``down_proj`` transposed ([E, D, F]); the state_dict names and shapes them as the host."""

    library = LIBRARY

    def forward(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """As the host's bmm experts: x in the weights' dtype, y returned in x's."""
        y = super().forward(x.to(self.fc1_weight.dtype), expert_indices, expert_weights)
        return y.to(x.dtype)

    def host_state(self) -> dict[str, torch.Tensor]:
        """``gate_up_proj`` [E, D, 2F] and ``down_proj`` [E, F, D]: transposed views."""
        fc1, fc2 = self.fc1_weight.detach(), self.fc2_weight.detach()
        return {"gate_up_proj": fc1.transpose(1, 2), "down_proj": fc2.transpose(1, 2)}

    def take_host_state(self, state_dict: dict, prefix: str, error_msgs: list[str]) -> None:
        for host, ours in zip(HOST_ORDER, ("fc1_weight", "fc2_weight"), strict=True):
            key = prefix + host
            if key not in state_dict:
                continue
            value, target = state_dict.pop(key), getattr(self, ours)
            want = (target.shape[0], target.shape[2], target.shape[1])
            if value.dim() != 3 or tuple(value.shape) != want:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                    f"from checkpoint, the shape in current model is {torch.Size(want)}."
                )
                continue
            state_dict[prefix + ours] = _like(value.transpose(1, 2), target)

    def __getattr__(self, name: str):
        """``gate_up_proj``/``down_proj`` read as the host's layout: read-only views of fc1
        and fc2 (write through ``load_state_dict``)."""
        if name in HOST_ORDER:
            return self.host_state()[name]
        return super().__getattr__(name)


class PatchedLlama4Moe(nn.Module):
    """What takes ``Llama4TextMoe``'s place: the host's router and shared expert, the routed
    experts run on the top-k experts' tokens alone. Returns (out [T, D], router_logits
    [T, E]) as the host does."""

    def __init__(self, host: nn.Module, experts: PatchedLlama4Experts) -> None:
        super().__init__()
        self.top_k, self.hidden_dim = host.top_k, host.hidden_dim
        self.num_experts = host.num_experts
        self.experts = experts  # registered in the host's order: its state_dict keys' order
        self.router = host.router
        self.shared_expert = host.shared_expert

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected experts' sigmoid scores (the router's own ``router_scores`` entries,
        so their gradients reach the router as the host's do) scale the experts' inputs."""
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        _, indices = torch.topk(router_logits, self.router.top_k, dim=1)  # the router's own
        routed_out = self.experts(hidden_states, indices, router_scores.gather(1, indices))
        out = self.shared_expert(hidden_states)
        return out + routed_out.to(out.dtype), router_logits


def fits(module: nn.Module) -> bool:
    """Llama-4's MoE block: a router, a shared expert and experts whose ``gate_up_proj`` and
    ``down_proj`` are 3-D parameters."""
    experts = module._modules.get("experts")
    if experts is None or not {"router", "shared_expert"} <= set(module._modules):
        return False
    up, down = experts._parameters.get("gate_up_proj"), experts._parameters.get("down_proj")
    return up is not None and down is not None and up.dim() == 3 and down.dim() == 3


def mismatch(module: nn.Module) -> str | None:
    """Why a block that fits is not Llama-4's MoE of SwiGLU experts; None when it is."""
    experts, router = module.experts, module.router
    why = module_mismatch(module)
    if why:
        return why
    for what, part, ref in (
        ("its", module, _moe_forward),
        ("its experts'", experts, _experts_forward),
        ("its router's", router, _Router.forward),
    ):
        forward = type(part).forward
        if not same_code(forward, ref):
            return (
                f"{what} forward ({_where(forward)}) is not transformers' Llama-4 MoE "
                "(Llama4TextMoe, Llama4TextExperts, Llama4Router)"
            )
    why = module_mismatch(experts) or _router(router)
    if why:
        return why
    act = getattr(experts, "act_fn", None)
    why = "its experts have no act_fn" if act is None else not_silu(act)
    return why or _weights(module)


def _router(router: nn.Module) -> str | None:
    """Why the router is not a plain bias-free linear whose super().forward is Linear's."""
    if "forward" in vars(router):
        return "its router's forward was replaced on the instance (a hook or another patch)"
    owner = next(c for c in type(router).__mro__ if "forward" in vars(c))
    parent = getattr(getattr(super(owner, router), "forward", None), "__func__", None)
    if not isinstance(router, nn.Linear) or parent is not nn.Linear.forward:
        return "its router is not an nn.Linear (its logits are not a plain linear's)"
    if router.bias is not None:
        return "its router has a bias"
    return None


def _weights(module: nn.Module) -> str | None:
    experts, router = module.experts, module.router
    why = gate_up_down_mismatch(experts, transposed=True)
    if why:
        return f"its experts: {why}"
    e, d, _ = experts.gate_up_proj.shape
    if tuple(router.weight.shape) != (e, d) or module.hidden_dim != d:
        return f"its router {tuple(router.weight.shape)} does not score {e} experts of size {d}"
    if not 1 <= router.top_k <= e:
        return f"its router's top_k {router.top_k} is not in 1..{e}"
    return None


def build(module: nn.Module, **options) -> PatchedLlama4Experts:
    """The patched experts on meta (options checked); Llama-4 scales the experts' input."""
    e, d, two_f = module.experts.gate_up_proj.shape
    return PatchedLlama4Experts(
        "Llama4TextExperts", e, d, two_f // 2, router_weights_on="input",
        dtype=module.experts.gate_up_proj.dtype, **options,
    )  # fmt: skip


def install(patched: PatchedLlama4Experts, module: nn.Module) -> PatchedLlama4Moe:
    """The block's replacement: fc1 and fc2 the host's weights transposed, copied once."""
    for ours, host in zip(("fc1_weight", "fc2_weight"), HOST_ORDER, strict=True):
        weight = getattr(module.experts, host)
        copy = weight.detach().transpose(1, 2).contiguous()
        setattr(patched, ours, nn.Parameter(copy, requires_grad=weight.requires_grad))
    return PatchedLlama4Moe(module, patched.train(module.experts.training)).train(module.training)


HOST = ExpertsHost(LIBRARY, fits, mismatch, build, install, walked=("shared_expert",))
