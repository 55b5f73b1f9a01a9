"""``drop_h`` with FP8 GEMMs, as a torchao ``Float8Linear`` fc1 and fc2 configure them.

torchao's ``convert_to_float8_training`` turns ParMLP's fc1 and fc2 into ``Float8Linear``s: each
GEMM casts its two operands to float8 (e4m3 or e5m2, tensorwise or rowwise scales, as the
module's ``Float8LinearConfig`` says for that GEMM's role) and runs ``torch._scaled_mm``. Run one
after the other, as ``normal`` does, the second keeps h in bf16 for its weight gradient. Here the
six GEMMs are cast exactly as those two modules would cast them (torchao's own
``hp_tensor_to_float8_dynamic``, or outside torch.compile where Triton runs the same bytes from
``kernels.float8_cast``'s two passes, in the layout ``_scaled_mm`` takes; then torchao's float8
tensor's ``mm``), and backward keeps drop_h's set:
x and the preactivation. fc2's forward operand, h in e4m3, comes straight from the
preactivation where Triton runs (``kernels.swiglu_float8``: h is never written in bf16 there);
in backward h is recomputed by the kernel that writes grad_preact, cast for grad_W2 and never
saved; that kernel finds the tensorwise amaxes of both, and grad_preact's per row, as it writes
them, so their casts do not read them for it.
With ``saved_fp8`` the preactivation is kept as drop_h's FP8 copy (``ops.fp8_saved``: e4m3, a
bf16 scale per row per 128 columns of each half), made in one pass with the h that fc2 casts,
and backward recomputes h and grad_preact from it. It runs unchunked: a chunk's tensorwise
cast would scale by the chunk's amax, not the tensor's, so the GEMMs would not be the recipe's.

A linear given as None (left in bf16 by the conversion) runs its GEMMs in the weights' dtype.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from swiglu_train.ops.activation import (
    swiglu_bwd_h_over_grad_h_amax_,
    swiglu_bwd_recompute_amax_,
    swiglu_fwd,
    triton_enabled,
)
from swiglu_train.ops.float8_casts import (
    Float8Gemms,
    along,
    cast_operand,
    dynamic_granularity,
    fp8_kernels_run,
    scale_of,
    shared_amax,
    torchao_float8,
)
from swiglu_train.ops.fp8_saved import (
    SECOND_BACKWARD_ERROR_FP8,
    SECOND_BACKWARD_FREED_ERROR_FP8,
    check_fp8_gpu,
    copy_buffers,
    free_copy,
    swiglu_bwd_fp8_,
    swiglu_bwd_fp8_amax_,
    swiglu_fwd_fp8_,
)
from swiglu_train.ops.mlp import (
    SECOND_BACKWARD_ERROR,
    SECOND_BACKWARD_FREED_ERROR,
    claim_inplace_backward,
    drop_h_grads,
    recompute_h,
    refuse_double_backward,
)

try:
    from swiglu_train.kernels import swiglu_float8 as kernels
except ImportError:  # no Triton on this platform: fc2 casts the h torch computes
    kernels = None

Amaxes = tuple[torch.Tensor | None, torch.Tensor | None]  # the two operands' shared amaxes
NO_AMAXES: Amaxes = (None, None)
# Each operand cast twice per step, by the two casts that may share its amax (``shared_amax``)
INPUT_CASTS = ("cast_config_input", "cast_config_input_for_grad_weight")
WEIGHT_CASTS = ("cast_config_weight", "cast_config_weight_for_grad_input")
GRAD_CASTS = ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")


def linear(
    x: torch.Tensor, weight: torch.Tensor, gemms: Float8Gemms | None, amaxes: Amaxes = NO_AMAXES
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ, in FP8 as the recipe casts a forward GEMM."""
    if gemms is None:
        return x @ weight.t()
    c = gemms.config
    a = cast_operand(x, c.cast_config_input, "INPUT", -1, gemms, amaxes[0])
    b = cast_operand(weight.t(), c.cast_config_weight, "WEIGHT", 0, gemms, amaxes[1])
    return torch.mm(a, b)


def grad_input(
    grad: torch.Tensor, weight: torch.Tensor, gemms: Float8Gemms | None, amaxes: Amaxes = NO_AMAXES
) -> torch.Tensor:
    """grad [M, N] @ weight [N, K], in FP8 as the recipe casts the input-gradient GEMM."""
    if gemms is None:
        return grad @ weight
    c = gemms.config
    a = cast_operand(grad, c.cast_config_grad_output, "GRAD_OUTPUT", -1, gemms, amaxes[0])
    w_cast = c.cast_config_weight_for_grad_input
    b = cast_operand(weight.t(), w_cast, "WEIGHT", -1, gemms, amaxes[1])
    return torch.mm(a, b.t())


def grad_weight(
    grad: torch.Tensor, x: torch.Tensor, gemms: Float8Gemms | None, amaxes: Amaxes = NO_AMAXES
) -> torch.Tensor:
    """grad [M, N]ᵀ @ x [M, K], in FP8 as the recipe casts the weight-gradient GEMM."""
    if gemms is None:
        return grad.t() @ x
    c = gemms.config
    g_cast = c.cast_config_grad_output_for_grad_weight
    a = cast_operand(grad, g_cast, "GRAD_OUTPUT", 0, gemms, amaxes[0])
    x_cast = c.cast_config_input_for_grad_weight  # recast from x in backward, not kept
    b = cast_operand(x, x_cast, "INPUT", 0, gemms, amaxes[1], after=grad)
    return torch.mm(a.t(), b)


def fc2_input(preact: torch.Tensor, gemms: Float8Gemms | None):
    """fc2's forward operand: h, or where the recipe casts it dynamically to e4m3 (tensorwise
    or per row) and Triton runs, h in e4m3 made from the preactivation without writing h,
    as torchao's ``Float8TrainingTensor`` with torchao's own scale of the same amax."""
    runs = kernels is not None and preact.shape[0] and triton_enabled(preact)
    if gemms is None or not runs or not fp8_kernels_run(preact):
        return swiglu_fwd(preact)
    cast = gemms.config.cast_config_input
    granularity = dynamic_granularity(gemms, "cast_config_input")
    if granularity is None or cast.target_dtype != torch.float8_e4m3fn:
        return swiglu_fwd(preact)
    ao, rowwise = torchao_float8(), granularity == "axiswise"
    amax = kernels.swiglu_row_amax(preact)
    amax = amax[:, None] if rowwise else amax.max()
    fused = not torch.compiler.is_compiling()  # else inductor fuses torchao's scale
    round_pow2 = gemms.config.round_scales_to_power_of_2
    scale = scale_of(amax, cast.target_dtype, round_pow2, fused)
    data = kernels.swiglu_cast_e4m3(preact, scale)
    role = ao.GemmInputRole.INPUT
    axiswise_dim = -1 if rowwise else None
    return ao.Float8TrainingTensor(data, scale, preact.dtype, gemms.mm_config, role, axiswise_dim)


def _bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias.to(out.dtype)


def _fc2_operand_and_saved(preact: torch.Tensor, gemms: Float8Gemms | None, saved_fp8: bool):
    """(fc2's forward operand, what backward keeps of the preactivation): the preact itself, or
    its FP8 copy and scales, written in one pass with h (preact is then no longer referenced)."""
    if not saved_fp8:
        return fc2_input(preact, gemms), (preact,)
    m, ffn = preact.shape[0], preact.shape[1] // 2
    h, copy = preact.new_empty(m, ffn), copy_buffers(m, ffn, preact)
    swiglu_fwd_fp8_(preact, h, *copy)
    return h, copy


class FoundAmaxes(NamedTuple):
    """The amaxes backward's SwiGLU kernel found as it wrote grad_preact and h (None: not found
    there, or not of the granularity the recipe casts by), each saving a full read."""

    grad_preact: torch.Tensor | None = None  # tensorwise, for both of grad_preact's casts
    grad_preact_rows: torch.Tensor | None = None  # [M, 1], for grad_x's (contracting 2F)
    h: torch.Tensor | None = None  # tensorwise, for grad_W2's cast of h


def _h_and_grad_preact(saved, grad_h, inplace: bool, fc1_gemms, fc2_gemms):
    """(h, grad_preact, FoundAmaxes) from the kept preact (over it and grad_h when ``inplace``)
    or from the FP8 copy (h over grad_h; the copy freed once read when ``inplace``). The kernel
    that writes them also finds the amaxes the recipe's dynamic casts of grad_preact and h scale
    by: tensorwise (both of grad_preact's casts; grad_W2's of h) and grad_preact's per row
    (grad_x's). The per-column amaxes grad_W1 and grad_W2 take under rowwise recipes are
    reductions over M, which a cast's read finds (``shared_amax``)."""
    grad_tensorwise = dynamic_granularity(fc1_gemms, *GRAD_CASTS) == "tensorwise"
    rowwise = dynamic_granularity(fc1_gemms, "cast_config_grad_output") == "axiswise"
    h_cast = dynamic_granularity(fc2_gemms, "cast_config_input_for_grad_weight")
    wanted = (grad_tensorwise or rowwise or h_cast == "tensorwise") and grad_h.shape[0] > 0
    amaxes = None  # (tensorwise pair, rows) where the kernel finds them
    if len(saved) == 2:  # from the copy: h over grad_h, grad_preact in a buffer of its own
        h, grad_preact = grad_h, grad_h.new_empty(grad_h.shape[0], 2 * grad_h.shape[1])
        if wanted:
            amaxes = swiglu_bwd_fp8_amax_(*saved, grad_h, grad_preact, rowwise)
        else:
            swiglu_bwd_fp8_(*saved, grad_h, grad_preact)
        free_copy(inplace, *saved)
    elif not wanted:
        h, grad_preact = recompute_h(saved[0], grad_h, inplace)
    elif inplace:
        amaxes = swiglu_bwd_recompute_amax_(saved[0], grad_h, rowwise)
        h, grad_preact = grad_h, saved[0]
    else:  # the saved preact stays whole; h over grad_h, which nothing reads after
        grad_preact, *amaxes = swiglu_bwd_h_over_grad_h_amax_(saved[0], grad_h, rowwise)
        h = grad_h
    if amaxes is None:
        return h, grad_preact, FoundAmaxes()
    pair, rows = amaxes
    found = FoundAmaxes(
        pair[0] if grad_tensorwise else None, rows if rowwise else None,
        pair[1] if h_cast == "tensorwise" else None,
    )  # fmt: skip
    return h, grad_preact, found


class _DropHFloat8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_gemms, fc2_gemms, inplace,
        saved_fp8,
    ):  # fmt: skip
        x_amax = shared_amax(x, fc1_gemms, *INPUT_CASTS)
        w1_amax = shared_amax(fc1_weight.t(), fc1_gemms, *WEIGHT_CASTS)
        w2_amax = shared_amax(fc2_weight.t(), fc2_gemms, *WEIGHT_CASTS)
        fc1_amaxes = (along(x_amax, -1), along(w1_amax, 0))
        preact = _bias(linear(x, fc1_weight, fc1_gemms, fc1_amaxes), fc1_bias)
        fc2_in, saved = _fc2_operand_and_saved(preact, fc2_gemms, saved_fp8)
        del preact  # with saved_fp8, freed before fc2's GEMM
        y = _bias(linear(fc2_in, fc2_weight, fc2_gemms, (None, along(w2_amax, 0))), fc2_bias)
        # backward's share: grad_W1's of x, grad_x's of W1ᵀ and grad_h's of W2ᵀ
        kept = (along(x_amax, 0), along(w1_amax, -1), along(w2_amax, -1))
        ctx.save_for_backward(x, fc1_weight, fc2_weight, *kept, *saved)
        ctx.gemms, ctx.inplace, ctx.backward_ran = (fc1_gemms, fc2_gemms), inplace, False
        ctx.has_bias = (fc1_bias is not None, fc2_bias is not None)
        ctx.saved_fp8 = saved_fp8
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        refuse_double_backward()
        errors = (SECOND_BACKWARD_ERROR_FP8, SECOND_BACKWARD_FREED_ERROR_FP8)
        if not ctx.saved_fp8:
            errors = (SECOND_BACKWARD_ERROR, SECOND_BACKWARD_FREED_ERROR)
        inplace = claim_inplace_backward(ctx, *errors)
        x, fc1_weight, fc2_weight, x_amax, w1_amax, w2_amax, *saved = ctx.saved_tensors
        fc1_gemms, fc2_gemms = ctx.gemms
        grad_y = grad_y.contiguous()
        grad_y_amax = shared_amax(grad_y, fc2_gemms, *GRAD_CASTS)
        grad_h_amaxes = (along(grad_y_amax, -1), w2_amax)
        grad_h = grad_input(grad_y, fc2_weight, fc2_gemms, grad_h_amaxes)
        h, grad_preact, found = _h_and_grad_preact(saved, grad_h, inplace, fc1_gemms, fc2_gemms)
        if ctx.needs_input_grad[3]:
            grad_w2 = grad_weight(grad_y, h, fc2_gemms, (along(grad_y_amax, 0), found.h))
        else:
            grad_w2 = None
        del h, grad_h
        grad_preact_amax = found.grad_preact  # else one read for both casts, if they share
        if grad_preact_amax is None:
            grad_preact_amax = shared_amax(grad_preact, fc1_gemms, *GRAD_CASTS)
        rows = found.grad_preact_rows
        input_amax = along(grad_preact_amax, -1) if rows is None else rows
        weight_amax = along(grad_preact_amax, 0)
        grads = drop_h_grads(
            ctx, x, fc1_weight, grad_preact, grad_y, grad_w2,
            input_grad=partial(grad_input, gemms=fc1_gemms, amaxes=(input_amax, w1_amax)),
            weight_grad=partial(grad_weight, gemms=fc1_gemms, amaxes=(weight_amax, x_amax)),
        )  # fmt: skip
        return *grads, None, None, None, None


def drop_h_float8_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    fc1_gemms: Float8Gemms | None,
    fc2_gemms: Float8Gemms | None,
    inplace: bool = True,
    saved_fp8: bool = False,
) -> torch.Tensor:
    """drop_h (x and the preactivation saved, h recomputed) with each linear's GEMMs in FP8 as
    its torchao recipe says (the module docstring); x is [M, D]. ``saved_fp8`` keeps the
    preactivation as drop_h's FP8 copy."""
    # the copy's kernels need sm_89: refused before any GEMM, as drop_h's FP8 copy is
    if saved_fp8 and x.is_cuda and not torch.compiler.is_compiling() and triton_enabled(x):
        check_fp8_gpu(x.get_device())
    return _DropHFloat8.apply(
        x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_gemms, fc2_gemms, inplace, saved_fp8
    )
