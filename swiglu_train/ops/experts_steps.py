"""The steps both drop_h experts Functions share (``ops.experts`` on torch's grouped GEMMs,
``ops.experts_quack`` on quack's gather GEMMs): they differ in their GEMMs only, so what they
save, how h and the FP8 copy are made and read back, and how the router weights' gradient
returns to slot order are written once, here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swiglu_train.ops.activation import swiglu_fwd, triton_enabled
from swiglu_train.ops.eager import eager_op
from swiglu_train.ops.experts_routing import Routing, restored_plan, saved_plan
from swiglu_train.ops.fp8_saved import copy_buffers, dequantize, free_copy, swiglu_fwd_fp8_
from swiglu_train.ops.mlp import claim_inplace_backward, refuse_double_backward
from swiglu_train.ops.reference import swiglu_grad

try:
    from swiglu_train.kernels import experts_swiglu as kernels
except ImportError:  # no Triton on this platform: the torch path serves everything
    kernels = None


def activate(preact: torch.Tensor, saved_fp8: bool) -> tuple[torch.Tensor, tuple]:
    """(h, what backward keeps of the preactivation): itself, or its e4m3 copy and scales, in
    which case the bf16 preactivation is dropped once h and the copy are written."""
    if not saved_fp8:
        return swiglu_fwd(preact), (preact,)
    rows, ffn = preact.shape[0], preact.shape[1] // 2
    h = preact.new_empty(rows, ffn)
    saved = copy_buffers(rows, ffn, preact)
    swiglu_fwd_fp8_(preact, h, *saved)
    return h, saved


def save(ctx, x, indices, weights, fc1, fc2, plan: Routing, saved: tuple, weights_on, inplace):
    """What every drop_h experts backward reads: x, the routing inputs and what it needs of
    their sorted plan (``saved_plan``: 4 bytes a slot, so backward neither sorts nor searches
    again), both weights and the preactivation (or its copy); h and the expert outputs are
    never kept."""
    ctx.save_for_backward(x, indices, weights, fc1, fc2, *saved_plan(plan), *saved)
    ctx.weights_on, ctx.inplace, ctx.backward_ran = weights_on, inplace, False


def saved_tensors(ctx, errors: tuple[str, str]) -> tuple[bool, tuple, Routing, list]:
    """(inplace, (x, indices, weights, fc1, fc2), the plan, the preactivation's tensors), after
    refusing a double or a second backward; out of place, the bf16 preactivation is a copy to
    overwrite."""
    refuse_double_backward()
    inplace = claim_inplace_backward(ctx, *errors)
    x, indices, weights, fc1, fc2, slot, offsets, *saved = ctx.saved_tensors
    plan = restored_plan(slot, offsets, indices, weights)
    if not inplace and len(saved) == 1:
        saved = [saved[0].clone()]
    return inplace, (x, indices, weights, fc1, fc2), plan, saved


def backward_rows(
    saved: list, g: torch.Tensor, w: torch.Tensor | None, inplace: bool, interleaved: bool = False
):
    """(grad_preact, (w·)h, grad_w [R] fp32 or None) from the saved preact, overwritten in
    place, or from its FP8 copy (q, scales), freed once read when ``inplace``; g [R, F] is
    overwritten by (w·)h where Triton runs. ``w`` is the router weight per sorted row when it
    scales the expert output (its gradient then comes from the same pass). ``interleaved``:
    the bf16 preact holds each feature's gate and up side by side (quack's gated epilogue),
    and grad_preact comes back so."""
    fp8 = len(saved) == 2
    if kernels is not None and triton_enabled(g):
        grad_w = torch.empty(g.shape[0], device=g.device) if w is not None else None
        if fp8:
            grad_preact = g.new_empty(g.shape[0], 2 * g.shape[1])
            experts_backward_fp8_(*saved, g, grad_preact, w, grad_w)
        else:
            grad_preact = saved[0]
            experts_backward_(grad_preact, g, w, grad_w, interleaved)
        wh = g
    else:
        preact = dequantize(*saved) if fp8 else saved[0].float()
        rows, ffn = g.shape
        if interleaved:  # [g0, u0, g1, u1, ...] -> [g0, g1, ... | u0, u1, ...]
            preact = preact.view(rows, ffn, 2).transpose(1, 2).reshape(rows, 2 * ffn)
        h = (F.silu(preact[:, :ffn]).to(g.dtype).float() * preact[:, ffn:]).to(g.dtype).float()
        scale = 1.0 if w is None else w[:, None]
        grad_preact = (swiglu_grad(preact, g.float()) * scale).to(g.dtype)
        if interleaved:
            grad_preact = grad_preact.view(rows, 2, ffn).transpose(1, 2).reshape(rows, 2 * ffn)
        grad_w = (g.float() * h).sum(-1) if w is not None else None
        wh = (h * scale).to(g.dtype)
    free_copy(inplace and fp8, *saved)
    return grad_preact, wh, grad_w


def release_preact(grad_preact: torch.Tensor, pinned: bool) -> None:
    """Once grad_W1 has read grad_preact for the last time. ``pinned``: in place, it is the
    saved preactivation, whose storage autograd's saved slot would hold until backward returns;
    its memory goes back now, so grad_W2's GEMM, computed after, never stands beside it. A
    second backward is refused before it reads the slot (``saved_tensors``)."""
    if pinned:
        grad_preact.untyped_storage().resize_(0)


# The Triton backward passes as ops torch.compile keeps opaque (``ops.eager``), as the dense
# layer's kernels are: a compiled model (torchtitan compiles each block) never traces a launch.
@eager_op("swiglu_train::experts_backward_", mutates_args=("preact", "g", "grad_w"))
def experts_backward_(
    preact: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    interleaved: bool,
) -> None:
    """``kernels.experts_backward_``: grad_preact over preact, (w·)h over g, grad_w."""
    kernels.experts_backward_(preact, g, w, grad_w, interleaved)


@experts_backward_.register_fake
def _(preact, g, w, grad_w, interleaved) -> None:
    return None


@eager_op("swiglu_train::experts_backward_fp8_", mutates_args=("g", "grad_preact", "grad_w"))
def experts_backward_fp8_(
    q: torch.Tensor,
    scales: torch.Tensor,
    g: torch.Tensor,
    grad_preact: torch.Tensor,
    w: torch.Tensor | None,
    grad_w: torch.Tensor | None,
) -> None:
    """``kernels.experts_backward_fp8``: from the e4m3 copy, into grad_preact; as above."""
    kernels.experts_backward_fp8(q, scales, g, grad_preact, w, grad_w)


@experts_backward_fp8_.register_fake
def _(q, scales, g, grad_preact, w, grad_w) -> None:
    return None


def router_grad(
    rows: torch.Tensor, bags: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The router weights' gradient [T, k] in their dtype, from its value per sorted row: back
    in slot order through the plan's bags (each slot's row), 0 for a dropped slot. Taken before
    the weight gradients, so that at the backward's peak it stands in place of the rows and the
    bags."""
    grad = rows.index_select(0, bags.reshape(-1)).view(indices.shape)
    return torch.where(indices >= 0, grad, 0.0).to(weights.dtype)
