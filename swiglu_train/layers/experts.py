"""``ParExperts``: the routed SwiGLU experts of a Mixture-of-Experts block, as one module.

Routing stays the caller's (router, top-k, load-balancing loss): the module takes the tokens,
their top-k expert indices and weights, and returns the weighted sum of the chosen experts'
outputs. Parameter names and shapes are the same for every impl, so a model switches impls
freely and checkpoints carry over: fc1_weight [E, 2F, D] (canonical [gate; up] per expert,
Megatron's and HF transformers 5's ``gate_up_proj`` layout) and fc2_weight [E, D, F] (HF's
``down_proj``).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from swiglu_train.ops.experts import IMPLS, WEIGHTS_ON, check_options, experts_mlp
from swiglu_train.ops.experts_quack import (
    check_experts_quack_runs,
    experts_quack_unavailable_reason,
)
from swiglu_train.ops.quack_mlp import QUACK_DTYPES

# What a dense impl name means for the routed experts, which have fewer impls, and why: both
# get drop_h's saved set, the one the experts' kernels are built for.
_EXPERTS_IMPL = {
    "save_factors": ("drop_h", "save_factors has no routed-experts form"),
    "save_factors_quack": ("drop_h_quack", "save_factors_quack has no routed-experts form"),
}


def experts_auto(
    hidden_size: int | None, ffn_hidden_size: int | None, router_weights_on: str
) -> tuple[str, str]:
    """(auto's experts impl on the current device, why). The rule, from the H100's MoE runs:
    drop_h_quack wherever it runs (sm_90, quack, D and F multiples of 8) with the router weight
    on the output, where its gather GEMMs ran 1-10 % faster than drop_h at the five models
    measured (moe_h100_peers.md, moe_wide_h100.md) with a lower backward peak (x's and grad_y's
    rows are never written); otherwise drop_h, which runs wherever torch does, and was faster
    with the weight on the input (Llama-4 Scout: 1.118x the floor against 1.183x,
    moe_llama4_h100.md), where quack's gated epilogue cannot scale the preactivation. Both keep
    the same parameters and saved bytes, so the choice never changes a checkpoint."""
    if router_weights_on == "input":
        return "drop_h", (
            "router weights on the input: drop_h (drop_h_quack's gated epilogue cannot scale "
            "the preactivation; 1.183x the floor against drop_h's 1.118x at Llama-4 Scout, H100)"
        )
    reason = experts_quack_unavailable_reason(hidden_size, ffn_hidden_size)
    if reason is not None:
        return "drop_h", f"drop_h: drop_h_quack cannot run here ({reason})"
    return "drop_h_quack", (
        "drop_h_quack: quack's gather GEMMs ran 1-10 % faster than drop_h at five MoE models "
        "on the H100, with a lower backward peak"
    )


def resolve_experts_impl(impl: str, requested: str | None) -> tuple[str, str | None]:
    """(the experts' impl, why it is not ``impl``) for a model whose MLPs take ``impl`` (any
    dense name, or ``auto``) and whose experts were asked for ``requested`` (None: follow
    ``impl``). ``auto`` stays auto: each ParExperts resolves it on its own sizes and device
    (``experts_auto``) and says why in ``auto_reason``. An experts impl not offered is refused
    in one line."""
    if requested is not None:
        if requested not in (*IMPLS, "auto"):
            raise ValueError(
                f"unknown experts impl {requested!r}; choose one of {(*IMPLS, 'auto')}"
            )
        return requested, None
    if impl in (*IMPLS, "auto"):
        return impl, None
    chosen, why = _EXPERTS_IMPL[impl]
    return chosen, f"{why}, so {chosen}; experts_impl= names one"


class ParExperts(nn.Module):
    """E SwiGLU experts of hidden size D and expert FFN size F, run as grouped GEMMs.

    ``impl``: "drop_h" (default: keeps x and the preactivation alone for backward) or
    "normal" (the reference; keeps the gathered input, preact, h and the expert outputs)
    or "drop_h_quack" (drop_h on quack's gather GEMMs; sm_90+, D and F multiples of 8), or
    "auto" (``experts_auto``: drop_h_quack where it runs on the current device with the router
    weight on the output, else drop_h; ``auto_reason`` says why).
    ``saved_fp8`` keeps drop_h's preactivation in e4m3 (1x128 blocks, bf16 scales).
    ``router_weights_on``: "output" (Mixtral, Qwen, DeepSeek) or "input" (Llama-4).
    ``inplace=False`` keeps the saved tensors intact so a graph can be backpropagated twice.
    ``gathered_wgrad=True`` (drop_h) runs grad_W1 in a Triton GEMM that reads x's rows itself,
    so backward never writes the gathered x [T·k, D] beside both weight gradients (its peak):
    on the H100, 192-255 MiB off the peak for 4-9 % of the step (docs/moe.md).
    Under autocast, x and the weights run in autocast's dtype and y comes back in it. On meta
    tensors (deferred init, tracing) y and the gradients come back as shapes alone.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        impl: str = "drop_h",
        saved_fp8: bool = False,
        router_weights_on: str = "output",
        inplace: bool = True,
        gathered_wgrad: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("ffn_hidden_size", ffn_hidden_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if router_weights_on not in WEIGHTS_ON:
            raise ValueError(
                f"router_weights_on must be one of {WEIGHTS_ON}, got {router_weights_on!r}"
            )
        if impl not in (*IMPLS, "auto"):
            raise ValueError(f"unknown experts impl {impl!r}; choose one of {(*IMPLS, 'auto')}")
        self.auto_reason = None  # why auto chose the impl; None when it was named
        if impl == "auto":
            impl, self.auto_reason = experts_auto(hidden_size, ffn_hidden_size, router_weights_on)
            if gathered_wgrad and impl == "drop_h_quack":  # its GEMMs gather x's rows already
                gathered_wgrad = False
                self.auto_reason += " (gathered_wgrad is drop_h's: these GEMMs gather inside)"
        check_options(impl, saved_fp8, router_weights_on, gathered_wgrad)
        if impl == "drop_h_quack":
            check_experts_quack_runs(hidden_size, ffn_hidden_size)
        self.num_experts, self.hidden_size, self.ffn_hidden_size = (
            num_experts,
            hidden_size,
            ffn_hidden_size,
        )
        self.impl, self.saved_fp8, self.inplace = impl, saved_fp8, inplace
        self.gathered_wgrad = gathered_wgrad
        self.router_weights_on = router_weights_on
        factory = {"device": device, "dtype": dtype}
        self.fc1_weight = nn.Parameter(
            torch.empty(num_experts, 2 * ffn_hidden_size, hidden_size, **factory)
        )
        self.fc2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, ffn_hidden_size, **factory)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised as an ``nn.Linear`` of its shape would be."""
        for weight in (self.fc1_weight, self.fc2_weight):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(
        self, x: torch.Tensor, expert_indices: torch.Tensor, expert_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [..., D] for tokens x [..., D] with their top-k indices and weights [..., k]."""
        lead = x.shape[:-1]
        if expert_indices.shape[:-1] != lead or expert_indices.dim() != x.dim():
            raise ValueError(
                f"expert_indices must be [..., k] over x's tokens {tuple(lead)}, got "
                f"{tuple(expert_indices.shape)}"
            )
        tokens, k = math.prod(lead), expert_indices.shape[-1]
        fc1, fc2 = self.fc1_weight, self.fc2_weight
        device_type = x.device.type
        autocast = device_type != "meta" and torch.is_autocast_enabled(device_type)
        if autocast:  # as ParMLP: grouped GEMMs take one dtype, and autocast does not cast them
            dtype = torch.get_autocast_dtype(device_type)  # (bf16-mixed: fp32 weights and x)
            x, fc1, fc2 = x.to(dtype), fc1.to(dtype), fc2.to(dtype)
        impl = self._impl_for(x.dtype, device_type)
        with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
            y = experts_mlp(
                x.reshape(tokens, x.shape[-1]),
                expert_indices.reshape(tokens, k),
                expert_weights.reshape(tokens, -1) if tokens else expert_weights.reshape(0, k),
                fc1,
                fc2,
                impl=impl,
                saved_fp8=self.saved_fp8,
                weights_on=self.router_weights_on,
                inplace=self.inplace,
                gathered_wgrad=self.gathered_wgrad,
            )
        return y.view(*lead, self.hidden_size)

    def _impl_for(self, dtype: torch.dtype, device_type: str) -> str:
        """The impl this call runs: drop_h for drop_h_quack on meta tensors (shapes only:
        deferred init, tracing; no quack kernel runs there), and where auto chose drop_h_quack,
        on a dtype or device quack's kernels cannot take, as ParMLP's auto does; drop_h keeps
        the same parameters and saved tensors, so a call may switch."""
        if self.impl != "drop_h_quack":
            return self.impl
        if device_type == "meta":
            return "drop_h"
        chosen_by_auto = self.auto_reason is not None
        if chosen_by_auto and (device_type != "cuda" or dtype not in QUACK_DTYPES):
            return "drop_h"
        return self.impl

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, impl={self.impl!r}"
            + (" (auto)" if self.auto_reason is not None else "")
            + f", saved_fp8={self.saved_fp8}, router_weights_on={self.router_weights_on!r}"
            + (", gathered_wgrad=True" if self.gathered_wgrad else "")
        )
