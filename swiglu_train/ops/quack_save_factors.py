"""The ``save_factors_quack`` impl: save_factors (seed 002) with both fusions in GEMM epilogues.

Forward is one GEMM, x @ W1_packedᵀ, whose epilogue (``kernels.quack_epilogues``) writes h and
the two backward factors [up * silu'(gate) | silu(gate)] and never stores the preactivation.
Backward is one GEMM, grad_y @ W2, whose epilogue multiplies grad_h by the saved
factors and writes grad_preact over them in place, so neither grad_h nor a new [M, 2F] buffer
reaches memory; grad_x and grad_W1 take grad_preact packed as it is.

The other GEMMs are plain products: each runs on quack's plain GEMM (untuned, on its static
or dynamic tile schedule) or cuBLAS, as ``ops.gemm_choice`` has it: what ``swiglu-train
pretune`` measured fastest for the shape on this GPU, else the defaults measured on the model
grid.

quack pairs adjacent output columns, so fc1 is packed with chunk 1 ([g_0, u_0, g_1, u_1, ...]);
checkpoints stay canonical through the layout stamp, as for ``save_factors``. Saved tensors
are save_factors' (x, h and the [M, 2F] factors): after-forward memory equals ``normal``'s, in
exchange for a backward with no recompute and no activation pass.
"""

from __future__ import annotations

import functools

import torch

from swiglu_train.ops.eager import eager_op
from swiglu_train.ops.fc2_node import Fc2Handoff, fc2_grad_y, fc2_or_h, with_fc2_node
from swiglu_train.ops.mlp import claim_inplace_backward, refuse_double_backward
from swiglu_train.ops.quack_mlp import (
    STATIC_FUSED,
    FusedSchedule,
    check_quack_inputs,
    chosen_gemm,
    quack_fc2,
    require_quack,
)
from swiglu_train.ops.save_factors import (
    SECOND_BACKWARD_ERROR_FACTORS,
    SECOND_BACKWARD_FREED_ERROR_FACTORS,
    save_factors_mlp,
)

IMPL = "save_factors_quack"
CHUNK = 1  # quack's pair order: gate and up of one column side by side


@functools.cache
def _epilogues():
    """The CuTe-DSL epilogues, imported once quack is known to load."""
    require_quack()
    from swiglu_train.kernels import quack_epilogues

    return quack_epilogues


@eager_op("swiglu_train::quack_swiglu_factors", mutates_args=())
def quack_swiglu_factors(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, dynamic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [M, F], factors [M, 2F]) from one GEMM on a chunk-1 packed fc1 (``dynamic``: on
    quack's dynamic tile schedule)."""
    epi = _epilogues()
    m, two_f = x.shape[0], fc1_weight.shape[0]
    factors = x.new_empty(m, two_f)
    h = x.new_empty(m, two_f // 2)
    options = {"out": {"D": factors, "h": h}, "tuned": False, "dynamic_scheduler": dynamic}
    if fc1_bias is None:
        epi.swiglu_factors_epilogue(x, fc1_weight.t(), **options)
    else:
        epi.swiglu_factors_bias_epilogue(x, fc1_weight.t(), bias=fc1_bias.unsqueeze(0), **options)
    return h, factors


@quack_swiglu_factors.register_fake
def _(x, fc1_weight, fc1_bias, dynamic):
    m, two_f = x.shape[0], fc1_weight.shape[0]
    return x.new_empty(m, two_f // 2), x.new_empty(m, two_f)


def _factors_to_grad(
    grad_y: torch.Tensor,
    fc2_weight: torch.Tensor,
    factors: torch.Tensor,
    out: torch.Tensor,
    dynamic: bool,
) -> None:
    _epilogues().factors_to_grad_epilogue(
        grad_y, fc2_weight, factors, out={"D": out}, tuned=False, dynamic_scheduler=dynamic
    )


@eager_op("swiglu_train::quack_factors_to_grad_", mutates_args=("factors",))
def quack_factors_to_grad_(
    grad_y: torch.Tensor, fc2_weight: torch.Tensor, factors: torch.Tensor, dynamic: bool
) -> None:
    """factors <- (grad_y @ W2) ⊙ factors = grad_preact, in place; grad_h never stored."""
    _factors_to_grad(grad_y, fc2_weight, factors, factors, dynamic)


@quack_factors_to_grad_.register_fake
def _(grad_y, fc2_weight, factors, dynamic):
    return None


@eager_op("swiglu_train::quack_factors_to_grad", mutates_args=())
def quack_factors_to_grad(
    grad_y: torch.Tensor, fc2_weight: torch.Tensor, factors: torch.Tensor, dynamic: bool
) -> torch.Tensor:
    """grad_preact = (grad_y @ W2) ⊙ factors into a new tensor (the factors kept)."""
    out = torch.empty_like(factors)
    _factors_to_grad(grad_y, fc2_weight, factors, out, dynamic)
    return out


@quack_factors_to_grad.register_fake
def _(grad_y, fc2_weight, factors, dynamic):
    return torch.empty_like(factors)


class _SaveFactorsQuack(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace: bool, dynamic: FusedSchedule,
        handoff: Fc2Handoff | None,
    ):  # fmt: skip
        x = x.contiguous()
        h, factors = quack_swiglu_factors(x, fc1_weight, fc1_bias, dynamic.fc1)
        ctx.save_for_backward(x, fc1_weight, fc2_weight, h, factors)
        ctx.inplace, ctx.has_bias = inplace, (fc1_bias is not None, fc2_bias is not None)
        ctx.dynamic_grad_h = dynamic.grad_h
        ctx.backward_ran = False
        return fc2_or_h(ctx, handoff, h, fc2_weight, fc2_bias, quack_fc2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        refuse_double_backward()
        inplace = claim_inplace_backward(
            ctx, SECOND_BACKWARD_ERROR_FACTORS, SECOND_BACKWARD_FREED_ERROR_FACTORS
        )
        x, fc1_weight, fc2_weight, h, factors = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        grad_y = fc2_grad_y(ctx, grad_out)
        if not (need_x or need_w1 or need_b1):  # a frozen fc1 fed by a frozen input
            grad_preact = None
        elif inplace:
            quack_factors_to_grad_(grad_y, fc2_weight, factors, ctx.dynamic_grad_h)
            grad_preact = factors
        else:
            grad_preact = quack_factors_to_grad(grad_y, fc2_weight, factors, ctx.dynamic_grad_h)
        grad_w2 = chosen_gemm("grad_w2", grad_y.t(), h) if need_w2 else None
        grad_x = chosen_gemm("grad_x_packed", grad_preact, fc1_weight) if need_x else None
        grad_w1 = chosen_gemm("grad_w1_packed", grad_preact.t(), x) if need_w1 else None
        grad_b1 = grad_preact.sum(0) if need_b1 and ctx.has_bias[0] else None
        grad_b2 = grad_y.sum(0) if need_b2 and ctx.has_bias[1] else None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None


def save_factors_quack_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    chunk: int = CHUNK,
    dynamic: FusedSchedule = STATIC_FUSED,
) -> torch.Tensor:
    """save_factors on quack's GEMMs (CUDA sm_90); fc1 weight and bias packed with chunk 1;
    ``dynamic`` puts the two fused GEMMs on quack's dynamic tile schedule (``FusedSchedule``).

    An empty batch (no tokens on this rank) takes save_factors itself: a TMA descriptor needs
    a row.
    """
    if chunk != CHUNK:
        raise ValueError(
            f"impl {IMPL!r} reads fc1 packed with chunk {CHUNK} (quack's pair order), got "
            f"chunk={chunk}: repack with swiglu_train.packing.switch_impl"
        )
    check_quack_inputs(x, fc1_weight, fc2_weight, IMPL)
    if x.shape[0] == 0:
        return save_factors_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace, CHUNK)
    return with_fc2_node(
        _SaveFactorsQuack, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, inplace, dynamic,
        fc2=quack_fc2,
    )  # fmt: skip
