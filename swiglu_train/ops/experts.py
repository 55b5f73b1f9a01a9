"""Routed SwiGLU experts (MoE): what each impl saves for backward, and how backward runs.

Inputs: x [T, D], expert_indices [T, k] (-1 drops a slot), expert_weights [T, k]; weights
fc1 [E, 2F, D] (canonical [gate; up] per expert) and fc2 [E, D, F]. With e = indices[t, j]:

    weights_on="output" (Mixtral, Qwen, DeepSeek):  y[t] = Σ_j w[t,j] · fc2[e] swiglu(fc1[e] x[t])
    weights_on="input"  (Llama-4):                  y[t] = Σ_j fc2[e] swiglu(fc1[e] (w[t,j] x[t]))

The experts run as grouped GEMMs over the slots sorted by expert (``experts_routing``); a
token's k rows are summed back by one deterministic gather-and-sum. R = T·k below.

``normal``  plain autograd, the reference: keeps the gathered input [R, D], preact [R, 2F],
            h [R, F] and the expert outputs [R, D] (for the router weight's gradient), as the
            eager MoE layers of HF transformers and torchtitan do.
``drop_h``  keeps x [T, D] (the caller's own tensor), the routing inputs and preact [R, 2F]
            alone, or with ``saved_fp8`` its e4m3 copy (``kernels.fp8_format``). Backward
            re-gathers x and grad_y, recomputes h inside the kernel that writes grad_preact,
            takes the router weight's gradient from that kernel's row sums
            (``kernels.experts_swiglu``; on the input side from one gather of x that grad_W1
            reuses): h and the expert outputs are never kept. With
            ``gathered_wgrad`` grad_W1's Triton GEMM reads x's rows itself
            (``kernels.experts_wgrad``), so the gathered x [R, D] is not written either: a
            lower backward peak, opt-in until its speed is measured on a GPU.
``drop_h_quack``  drop_h on quack's GEMMs, which gather the rows inside the GEMM: the
            gathered x and grad_y are never written. With the weight on the output and a
            bf16 preactivation, SwiGLU runs in fc1's GEMM epilogue too; backward is drop_h's
            Triton pass on quack's interleaved preact (``ops.experts_quack``; sm_90+).
"""

from __future__ import annotations

import torch

from swiglu_train.kernels.fp8_format import copy_bytes
from swiglu_train.ops.experts_peak import grad_fc2_first
from swiglu_train.ops.experts_quack import drop_h_quack_experts
from swiglu_train.ops.experts_routing import (
    check_routing,
    combine,
    gather_sum,
    gathered_row_dots,
    gathered_weight_grad,
    gathers_in_gemm,
    grouped_linear,
    grouped_weight_grad,
    live_weights,
    route,
    routing_bytes,
    row_dots,
    rows_weight_grad,
)
from swiglu_train.ops.experts_steps import (
    activate,
    backward_rows,
    release_preact,
    router_grad,
    save,
    saved_tensors,
)
from swiglu_train.ops.mlp import refuse_double_backward, swiglu_activation
from swiglu_train.ops.weights import check_plain_weights

WEIGHTS_ON = ("output", "input")
IMPLS = ("normal", "drop_h", "drop_h_quack")
SECOND_BACKWARD_ERROR = (
    "ParExperts(impl='drop_h') ran its backward in place: its saved preactivation now holds "
    "the gradient (or, with saved_fp8, was freed once read), so a second backward through "
    "this graph (retain_graph=True) would compute garbage. Build the layer with "
    "inplace=False to backpropagate more than once."
)
SECOND_BACKWARD_FREED_ERROR = (
    "ParExperts(impl='drop_h'): a second backward through the same graph, whose saved tensors "
    "the first backward freed (it ran without retain_graph=True). Build the layer with "
    "inplace=False and pass retain_graph=True to every backward but the last."
)


class _GroupedLinear(torch.autograd.Function):
    """Rows of expert e times weight[e]ᵀ, saving its input: ``normal``'s GEMM node."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
        ctx.save_for_backward(a, weight, offsets)
        return grouped_linear(a, weight, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_double_backward()
        a, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grouped_linear(grad, weight.transpose(1, 2), offsets)
        grad_w = grouped_weight_grad(grad, a, offsets) if ctx.needs_input_grad[1] else None
        return grad_a, grad_w, None


def normal_experts(x, indices, weights, fc1, fc2, weights_on: str, **_) -> torch.Tensor:
    """The reference impl: plain autograd through grouped GEMMs."""
    plan = route(indices, weights, fc1.shape[0])
    w = live_weights(indices, weights)
    xg = x.index_select(0, plan.token)
    if weights_on == "input":
        xg = xg * w.reshape(-1).index_select(0, plan.slot).to(x.dtype)[:, None]
    h = swiglu_activation(_GroupedLinear.apply(xg, fc1, plan.offsets))
    out = _GroupedLinear.apply(h, fc2, plan.offsets)
    return combine(out, plan, None if weights_on == "input" else w)


class _ExpertsDropH(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, indices, weights, fc1, fc2, weights_on: str, saved_fp8: bool, inplace, gathered
    ):
        plan = route(indices, weights, fc1.shape[0])
        xg = x.index_select(0, plan.token)
        if weights_on == "input":
            xg.mul_(plan.weight.to(x.dtype)[:, None])
        preact = grouped_linear(xg, fc1, plan.offsets)
        del xg
        h, saved = activate(preact, saved_fp8)
        del preact
        out = grouped_linear(h, fc2, plan.offsets)
        del h
        y = gather_sum(
            out, plan.bags, None if weights_on == "input" else live_weights(indices, weights)
        )
        save(ctx, x, indices, weights, fc1, fc2, plan, saved, weights_on, inplace)
        ctx.gathered_wgrad = gathered
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        errors = (SECOND_BACKWARD_ERROR, SECOND_BACKWARD_FREED_ERROR)
        inplace, (x, indices, weights, fc1, fc2), plan, saved = saved_tensors(ctx, errors)
        # the plan's parts, each dropped once read for the last time: the peak keeps the token
        token, bags, offsets, weight = plan.token, plan.bags, plan.offsets, plan.weight
        del plan
        on_output = ctx.weights_on == "output"
        grad_yg = grad_y.contiguous().index_select(0, token)
        g = grouped_linear(grad_yg, fc2.transpose(1, 2), offsets)  # unweighted grad_h
        w = weight if on_output else None
        grad_preact, wh, grad_w_rows = backward_rows(saved, g, w, inplace)
        scale = None if on_output else weight  # an input-side weight scales grad_W1's x rows
        pinned = inplace and grad_preact is saved[0]  # released once grad_W1 has read it
        del saved, g, w, weight
        in_gemm = gathers_in_gemm(ctx.gathered_wgrad, grad_preact)  # else grad_W1 gathers x
        fc2_first = grad_fc2_first(
            grad_w2=fc2.numel(),
            grad_preact=grad_preact.numel(),
            waiting=grad_yg.numel() + wh.numel(),
            gathered=0 if in_gemm else token.numel() * x.shape[-1],
        )
        if fc2_first:
            grad_fc2 = grouped_weight_grad(grad_yg, wh, offsets)
            grad_yg = wh = None
        grad_xg = grouped_linear(grad_preact, fc1.transpose(1, 2), offsets)
        xg = None  # x's rows, where grad_W1's GEMM needs them gathered
        if not on_output:  # d(w x)/dw = x: the router's gradient from grad_xg before scaling
            if in_gemm:  # chunked: grad_W1's GEMM reads x's rows itself
                grad_w_rows = gathered_row_dots(grad_xg, x, token)
            else:  # one gather serves this dot and grad_W1 (scaled in place there)
                xg = x.index_select(0, token)
                grad_w_rows = row_dots(grad_xg, xg)
        grad_w = router_grad(grad_w_rows, bags, indices, weights)
        # grad_x before grad_W1 is allocated: the step's peak then holds [T, D], not [R, D]
        grad_x = gather_sum(grad_xg, bags, None if on_output else live_weights(indices, weights))
        del grad_xg, grad_w_rows, bags
        # beside both weight gradients, the step's peak: with gathered_wgrad, x's rows are
        # read inside the GEMM, not gathered to [R, D] first; gathered first, the token is
        # read for the last time here
        if in_gemm:
            grad_fc1 = gathered_weight_grad(grad_preact, x, token, offsets, scale, True)
        else:
            xg = x.index_select(0, token) if xg is None else xg
            del token
            grad_fc1 = rows_weight_grad(grad_preact, xg, offsets, scale)
        release_preact(grad_preact, pinned)
        del grad_preact, xg
        if not fc2_first:
            grad_fc2 = grouped_weight_grad(grad_yg, wh, offsets)
        return grad_x, None, grad_w, grad_fc1, grad_fc2, None, None, None, None


def saved_activation_bytes(
    impl: str,
    saved_fp8: bool,
    weights_on: str,
    tokens: int,
    hidden: int,
    ffn: int,
    top_k: int,
    experts: int,
    dtype: torch.dtype,
) -> int:
    """Bytes an impl keeps for backward beyond the parameters and the caller's own tensors (x,
    the indices and weights), for T tokens routed to k of E experts each (R = T·k slots): what
    the memory tests assert and the benchmarks report. The drop_h impls keep the routing plan
    (``routing_bytes``); ``normal`` keeps a few index vectors (O(R) integers, which torch's
    gather and bag ops save) not counted here."""
    size, rows = torch.empty(0, dtype=dtype).element_size(), tokens * top_k
    if impl == "normal":
        gathered = 2 if weights_on == "input" else 1  # the scaled copy of the gathered x too
        outputs = 1 if weights_on == "output" else 0  # the expert outputs, for the weights' grad
        return size * rows * ((gathered + outputs) * hidden + 3 * ffn)
    plan = routing_bytes(rows, experts)
    if saved_fp8:
        return plan + copy_bytes(rows, ffn)
    return plan + size * rows * 2 * ffn


def drop_h_experts(
    x, indices, weights, fc1, fc2, weights_on, saved_fp8=False, inplace=True, gathered_wgrad=False
):
    """Seed 000's drop-h for routed experts (the module docstring)."""
    return _ExpertsDropH.apply(
        x, indices, weights, fc1, fc2, weights_on, saved_fp8, inplace, gathered_wgrad
    )


_IMPLS = {
    "normal": normal_experts,
    "drop_h": drop_h_experts,
    "drop_h_quack": drop_h_quack_experts,
}


def experts_mlp(
    x: torch.Tensor,
    expert_indices: torch.Tensor,
    expert_weights: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    impl: str = "drop_h",
    saved_fp8: bool = False,
    weights_on: str = "output",
    inplace: bool = True,
    gathered_wgrad: bool = False,
) -> torch.Tensor:
    """y [T, D] of the routed experts (the module docstring), after checking every input."""
    check_options(impl, saved_fp8, weights_on, gathered_wgrad)
    check_routing(x, expert_indices, expert_weights, fc1_weight.shape[0])
    check_weights(x, fc1_weight, fc2_weight)
    check_plain_weights("experts", (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)))
    return _IMPLS[impl](
        x, expert_indices, expert_weights, fc1_weight, fc2_weight, weights_on,
        saved_fp8=saved_fp8, inplace=inplace, gathered_wgrad=gathered_wgrad,
    )  # fmt: skip


def check_options(impl: str, saved_fp8: bool, weights_on: str, gathered_wgrad: bool) -> None:
    """A one-line error for an impl, weight order or option the experts do not offer."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown experts impl {impl!r}; choose one of {tuple(_IMPLS)}")
    if weights_on not in WEIGHTS_ON:
        raise ValueError(f"weights_on must be one of {WEIGHTS_ON}, got {weights_on!r}")
    if saved_fp8 and impl == "normal":
        raise ValueError("saved_fp8=True needs impl='drop_h' (normal saves h as well)")
    if gathered_wgrad and impl != "drop_h":
        raise ValueError(
            f"gathered_wgrad=True needs impl='drop_h', got {impl!r} (drop_h_quack's GEMMs "
            "gather inside already; normal keeps the gathered x)"
        )


def check_weights(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
    """A one-line error unless fc1 is [E, 2F, D] and fc2 [E, D, F] in x's dtype and device."""
    if fc1.dim() != 3 or fc2.dim() != 3 or fc1.shape[1] % 2:
        raise ValueError(
            f"fc1_weight must be [E, 2F, D] and fc2_weight [E, D, F], got "
            f"{tuple(fc1.shape)} and {tuple(fc2.shape)}"
        )
    e, two_f, d = fc1.shape
    if tuple(fc2.shape) != (e, d, two_f // 2) or d != x.shape[1]:
        raise ValueError(
            f"fc2_weight must be [E, D, F] = [{e}, {d}, {two_f // 2}] for fc1_weight "
            f"{tuple(fc1.shape)}, and x [T, {d}]; got fc2 {tuple(fc2.shape)}, x {tuple(x.shape)}"
        )
    for name, w in (("fc1_weight", fc1), ("fc2_weight", fc2)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(
                f"{name} is {w.dtype} on {w.device}, x is {x.dtype} on {x.device}: they must match"
            )
