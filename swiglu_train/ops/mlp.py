"""The autograd side of each ParMLP impl: what is saved for backward, and how backward runs.

All functions take a 2D x [M, D] and canonical weights: fc1 [2F, D] = [W_gate; W_up], fc2 [O, F].

``normal``  saves preact (the activation Function) and h (fc2's F.linear), like eager Megatron.
``drop_h``  saves preact only; backward recomputes h with grad_preact in one fused kernel,
            by default in place: grad_preact over preact and h over grad_h.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from swiglu_train.ops.activation import (
    swiglu_bwd,
    swiglu_bwd_recompute,
    swiglu_bwd_recompute_,
    swiglu_fwd,
)
from swiglu_train.ops.fc2_node import Fc2Handoff, fc2_grad_y, fc2_or_h, with_fc2_node
from swiglu_train.ops.gated import gated_enabled, gated_fwd

SECOND_BACKWARD_ERROR = (
    "ParMLP(impl='drop_h' or 'drop_h_quack') ran its backward in place: the saved preactivation"
    " now holds its gradient, so a second backward through this graph (retain_graph=True) would"
    " compute garbage. Build the layer with inplace=False to backpropagate more than once."
)
SECOND_BACKWARD_FREED_ERROR = (
    "ParMLP(impl='drop_h' or 'drop_h_quack'): a second backward through the same graph, whose "
    "saved tensors the first backward freed (it ran without retain_graph=True). retain_graph=True"
    " alone would not help: this impl's backward runs in place and overwrites the saved "
    "preactivation with its gradient. To backpropagate more than once, build the layer with "
    "inplace=False and pass retain_graph=True to every backward but the last."
)


DOUBLE_BACKWARD_ERROR = (
    "ParMLP's backward is not itself differentiable: its kernels and custom ops have no "
    "derivatives, so create_graph=True (double backward, as in a gradient penalty) would "
    "record a graph that silently misses terms. Differentiate a plain torch MLP for that "
    "(swiglu_train.ops.reference.mlp computes the same function)."
)


def refuse_double_backward() -> None:
    """Raise where autograd would record this backward for a second differentiation."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def saved_tensors_freed(ctx) -> bool:
    """Whether a backward without retain_graph=True already freed ``ctx``'s saved tensors.

    Read through ``_raw_saved_tensors``, which checks only that: ``saved_tensors`` would also
    unpack them and fail on the version bump of our in-place backward, a different error.
    """
    try:
        ctx._raw_saved_tensors  # noqa: B018 (raises torch's backward-twice error once freed)
    except RuntimeError:
        return True
    except AttributeError:  # private: a torch without it gets the retained-graph message
        return False
    return False


def claim_inplace_backward(ctx, error: str, freed_error: str) -> bool:
    """Whether this backward may overwrite its saved tensors; a second backward through the
    same graph raises (checked before the overwritten tensors are read): ``error`` when the
    graph was retained, ``freed_error`` when it was not. Torch's own message for the latter
    advises retain_graph=True, which cannot help a backward that overwrote what it saved.

    Under torch.compile it runs out of place: functionalization makes mutations copies anyway.
    """
    if not ctx.inplace or torch.compiler.is_compiling():
        return False
    if ctx.backward_ran:
        raise RuntimeError(freed_error if saved_tensors_freed(ctx) else error)
    ctx.backward_ran = True
    return True


class _SwiGLU(torch.autograd.Function):
    """The activation alone, saving preact; fc2's F.linear saves h next to it."""

    @staticmethod
    def forward(ctx, preact: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(preact)
        return swiglu_fwd(preact)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor) -> torch.Tensor:
        refuse_double_backward()
        (preact,) = ctx.saved_tensors
        return swiglu_bwd(preact, grad_h.contiguous())


def swiglu_activation(preact: torch.Tensor) -> torch.Tensor:
    """h from a [M, 2F] canonical preact, saving preact alone, for callers whose own fc2
    saves h (Megatron's Transformer Engine linears): the `normal` impl's activation."""
    return _SwiGLU.apply(preact)


def normal_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
) -> torch.Tensor:
    """The seed's baseline: cuBLAS GEMMs around a Triton activation; `inplace` is unused."""
    h = swiglu_activation(F.linear(x, fc1_weight, fc1_bias))
    return F.linear(h, fc2_weight, fc2_bias)


def save_drop_h(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, preact, inplace) -> None:
    """What every drop_h backward reads: x, both weights and the preact (h is recomputed)."""
    ctx.save_for_backward(x, fc1_weight, fc2_weight, preact)
    ctx.inplace = inplace
    ctx.has_bias = (fc1_bias is not None, fc2_bias is not None)
    ctx.backward_ran = False


class _DropH(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        fc1_weight: torch.Tensor,
        fc1_bias: torch.Tensor | None,
        fc2_weight: torch.Tensor,
        fc2_bias: torch.Tensor | None,
        inplace: bool,
        fused_forward: bool,
        handoff: Fc2Handoff | None,
    ) -> torch.Tensor:
        ffn = fc1_weight.shape[0] // 2
        if fused_forward and gated_enabled(x, ffn, ffn):  # canonical = packed with chunk F
            h, preact = gated_fwd(x, fc1_weight, fc1_bias, ffn, "preact")
        else:
            preact = F.linear(x, fc1_weight, fc1_bias)
            h = swiglu_fwd(preact)
        save_drop_h(ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, preact, inplace)
        return fc2_or_h(ctx, handoff, h, fc2_weight, fc2_bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        refuse_double_backward()
        inplace = claim_inplace_backward(ctx, SECOND_BACKWARD_ERROR, SECOND_BACKWARD_FREED_ERROR)
        x, fc1_weight, fc2_weight, preact = ctx.saved_tensors
        need_w2 = ctx.needs_input_grad[3]
        grad_y = fc2_grad_y(ctx, grad_out)
        h, grad_preact = recompute_h(preact, grad_y @ fc2_weight, inplace)
        grad_w2 = grad_y.t() @ h if need_w2 else None
        del h  # frees the [M, F] buffer before the two largest GEMM outputs are allocated
        return *drop_h_grads(ctx, x, fc1_weight, grad_preact, grad_y, grad_w2), None, None, None


def recompute_h(
    preact: torch.Tensor, grad_h: torch.Tensor, inplace: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, grad_preact) from the saved preact and grad_h in one kernel: in place, grad_preact
    over preact and h over grad_h (drop_h's backward holds no new [M, 2F] or [M, F] buffer);
    out of place, into new ones."""
    if inplace:
        swiglu_bwd_recompute_(preact, grad_h)
        return grad_h, preact
    return swiglu_bwd_recompute(preact, grad_h)


def drop_h_grads(
    ctx,
    x,
    fc1_weight,
    grad_preact,
    grad_y,
    grad_w2,
    input_grad: Callable = torch.mm,
    weight_grad: Callable = lambda grad, x: grad.t() @ x,
) -> tuple:
    """(grad_x, grad_W1, grad_b1, grad_W2, grad_b2) as autograd asked for them, from
    grad_preact: how every portable drop_h backward ends (``save_drop_h``'s ctx), on cuBLAS or
    on the GEMMs given (the FP8 ones of ``ops.float8_mlp``)."""
    need_x, need_w1, need_b1, _, need_b2 = ctx.needs_input_grad[:5]
    grad_x = input_grad(grad_preact, fc1_weight) if need_x else None
    grad_w1 = weight_grad(grad_preact, x) if need_w1 else None
    grad_b1 = grad_preact.sum(0) if need_b1 and ctx.has_bias[0] else None
    grad_b2 = grad_y.sum(0) if need_b2 and ctx.has_bias[1] else None
    return grad_x, grad_w1, grad_b1, grad_w2, grad_b2


def drop_h_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    fused_forward: bool = False,
) -> torch.Tensor:
    """Seed 000's drop-h, with an in-place fused backward unless `inplace` is False.

    ``fused_forward`` computes h and the saved preact in one gated GEMM (the preact is never
    read back). Off by default: on the H200 our Triton GEMM is ~7 % slower than cuBLAS, which
    outweighs the activation pass it saves (benchmarks/results/gemm/tune_gated_h200.json).
    fc2 runs in a node of its own, which a checkpoint's recompute stops before (``fc2_node``).
    """
    return with_fc2_node(
        _DropH, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace, fused_forward
    )
