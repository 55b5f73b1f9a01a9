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
saved.
With ``saved_fp8`` the preactivation is kept as drop_h's FP8 copy (``ops.fp8_saved``: e4m3, a
bf16 scale per row per 128 columns of each half), made in one pass with the h that fc2 casts,
and backward recomputes h and grad_preact from it. It runs unchunked: a chunk's tensorwise
cast would scale by the chunk's amax, not the tensor's, so the GEMMs would not be the recipe's.

A linear given as None (left in bf16 by the conversion) runs its GEMMs in the weights' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from swiglu_train.kernels.fp8_format import MIN_CAPABILITY
from swiglu_train.kernels.runtime import device_capability
from swiglu_train.ops.activation import swiglu_fwd, triton_enabled
from swiglu_train.ops.fp8_saved import (
    SECOND_BACKWARD_ERROR_FP8,
    SECOND_BACKWARD_FREED_ERROR_FP8,
    check_fp8_gpu,
    copy_buffers,
    free_copy,
    swiglu_bwd_fp8_,
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
    from swiglu_train.kernels import float8_cast as cast_kernels
    from swiglu_train.kernels import swiglu_float8 as kernels
except ImportError:  # no Triton on this platform: torchao casts, fc2 casts the h torch computes
    cast_kernels = kernels = None

# torchao's float8 training linear: the class its converter installs (float8/float8_linear.py).
TORCHAO_FLOAT8_LINEAR = ("torchao.float8.float8_linear", "Float8Linear")


@dataclass(frozen=True)
class Float8Gemms:
    """One linear's FP8 recipe: torchao's ``Float8LinearConfig`` and the ``LinearMMConfig`` its
    ``Float8Linear`` built from it (fast accumulation and padding per GEMM)."""

    config: object
    mm_config: object

    @classmethod
    def of(cls, linear: nn.Module) -> Float8Gemms | None:
        """The recipe of a torchao ``Float8Linear``, or None for any other linear."""
        kind = type(linear)
        if (kind.__module__, kind.__qualname__) != TORCHAO_FLOAT8_LINEAR:
            return None
        return cls(linear.config, linear.linear_mm_config)


def is_torchao_float8(linear: nn.Module) -> bool:
    return Float8Gemms.of(linear) is not None


def _cast(t: torch.Tensor, cast_config, role: str, dim: int, gemms: Float8Gemms):
    """``t`` as the float8 operand of one GEMM, or itself where the recipe leaves it unscaled
    or it arrives cast already (FSDP2's float8 all-gather of the weights)."""
    from torchao.float8.config import ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )
    from torchao.float8.float8_training_tensor import GemmInputRole

    if cast_config.scaling_type is ScalingType.DISABLED or tensor_already_casted_to_fp8(t):
        return t
    if _fused_cast_runs(t):
        return _fused_cast(t, cast_config, role, dim, gemms)
    return hp_tensor_to_float8_dynamic(
        t,
        cast_config.target_dtype,
        gemms.mm_config,
        gemm_input_role=getattr(GemmInputRole, role),
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(dim, cast_config.scaling_granularity),
        round_scales_to_power_of_2=gemms.config.round_scales_to_power_of_2,
    )


def _fp8_kernels_run(t: torch.Tensor) -> bool:
    """Whether Triton's fp8 conversions compile for ``t``'s device (sm_89+, or the CPU's
    interpreter): below that, torchao's ``emulate`` recipes still cast in torch."""
    return not t.is_cuda or device_capability(t.get_device()) >= MIN_CAPABILITY


def _fused_cast_runs(t: torch.Tensor) -> bool:
    """Whether ``kernels.float8_cast`` casts ``t``: a plain non-empty 2D tensor (not a DTensor
    or another subclass, whose cast torchao handles) where Triton runs, outside torch.compile
    (whose inductor fuses torchao's cast itself)."""
    return (
        cast_kernels is not None
        and type(t) is torch.Tensor
        and t.dim() == 2
        and t.numel() > 0
        and not torch.compiler.is_compiling()
        and triton_enabled(t)
        and _fp8_kernels_run(t)
    )


def _fused_cast(t: torch.Tensor, cast_config, role: str, dim: int, gemms: Float8Gemms):
    """torchao's dynamic cast of ``t`` in two Triton passes with torchao's scale between them,
    the bytes laid out as ``torch._scaled_mm`` takes them (``dim``, the contraction, contiguous),
    so torchao's mm copies nothing."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_utils import amax_to_scale

    granularity = cast_config.scaling_granularity
    rowwise = granularity is ScalingGranularity.AXISWISE
    dtype = cast_config.target_dtype
    amax = cast_kernels.amax(t, dim, rowwise)
    scale = amax_to_scale(amax, dtype, gemms.config.round_scales_to_power_of_2)
    data = cast_kernels.cast(t, scale, dim, dtype)
    axiswise_dim = get_maybe_axiswise_dim(dim, granularity)
    role = getattr(GemmInputRole, role)
    return Float8TrainingTensor(data, scale, t.dtype, gemms.mm_config, role, axiswise_dim)


def linear(x: torch.Tensor, weight: torch.Tensor, gemms: Float8Gemms | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ, in FP8 as the recipe casts a forward GEMM."""
    if gemms is None:
        return x @ weight.t()
    c = gemms.config
    a = _cast(x, c.cast_config_input, "INPUT", -1, gemms)
    b = _cast(weight.t(), c.cast_config_weight, "WEIGHT", 0, gemms)
    return torch.mm(a, b)


def grad_input(grad: torch.Tensor, weight: torch.Tensor, gemms: Float8Gemms | None):
    """grad [M, N] @ weight [N, K], in FP8 as the recipe casts the input-gradient GEMM."""
    if gemms is None:
        return grad @ weight
    c = gemms.config
    a = _cast(grad, c.cast_config_grad_output, "GRAD_OUTPUT", -1, gemms)
    b = _cast(weight.t(), c.cast_config_weight_for_grad_input, "WEIGHT", -1, gemms)
    return torch.mm(a, b.t())


def grad_weight(grad: torch.Tensor, x: torch.Tensor, gemms: Float8Gemms | None):
    """grad [M, N]ᵀ @ x [M, K], in FP8 as the recipe casts the weight-gradient GEMM."""
    if gemms is None:
        return grad.t() @ x
    c = gemms.config
    a = _cast(grad, c.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0, gemms)
    b = _cast(x, c.cast_config_input_for_grad_weight, "INPUT", 0, gemms)
    return torch.mm(a.t(), b)


def fc2_input(preact: torch.Tensor, gemms: Float8Gemms | None):
    """fc2's forward operand: h, or where the recipe casts it dynamically to e4m3 (tensorwise
    or per row) and Triton runs, h in e4m3 made from the preactivation without writing h,
    as torchao's ``Float8TrainingTensor`` with torchao's own scale of the same amax."""
    if gemms is None or kernels is None or preact.shape[0] == 0 or not triton_enabled(preact):
        return swiglu_fwd(preact)
    if not _fp8_kernels_run(preact):
        return swiglu_fwd(preact)
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_utils import amax_to_scale

    cast = gemms.config.cast_config_input
    if cast.scaling_type is not ScalingType.DYNAMIC or cast.target_dtype != torch.float8_e4m3fn:
        return swiglu_fwd(preact)
    rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    amax = kernels.swiglu_row_amax(preact)
    amax = amax[:, None] if rowwise else amax.max()
    scale = amax_to_scale(amax, cast.target_dtype, gemms.config.round_scales_to_power_of_2)
    data = kernels.swiglu_cast_e4m3(preact, scale)
    return Float8TrainingTensor(
        data, scale, preact.dtype, gemms.mm_config, GemmInputRole.INPUT, -1 if rowwise else None
    )


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


def _h_and_grad_preact(saved: list[torch.Tensor], grad_h: torch.Tensor, inplace: bool):
    """(h, grad_preact) from the kept preact (over it and grad_h when ``inplace``) or from the
    FP8 copy (h over grad_h; the copy freed once read when ``inplace``)."""
    if len(saved) == 1:
        return recompute_h(saved[0], grad_h, inplace)
    grad_preact = grad_h.new_empty(grad_h.shape[0], 2 * grad_h.shape[1])
    swiglu_bwd_fp8_(*saved, grad_h, grad_preact)
    free_copy(inplace, *saved)
    return grad_h, grad_preact


class _DropHFloat8(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_gemms, fc2_gemms, inplace,
        saved_fp8,
    ):  # fmt: skip
        preact = _bias(linear(x, fc1_weight, fc1_gemms), fc1_bias)
        fc2_in, saved = _fc2_operand_and_saved(preact, fc2_gemms, saved_fp8)
        del preact  # with saved_fp8, freed before fc2's GEMM
        y = _bias(linear(fc2_in, fc2_weight, fc2_gemms), fc2_bias)
        ctx.save_for_backward(x, fc1_weight, fc2_weight, *saved)
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
        x, fc1_weight, fc2_weight, *saved = ctx.saved_tensors
        fc1_gemms, fc2_gemms = ctx.gemms
        grad_y = grad_y.contiguous()
        grad_h = grad_input(grad_y, fc2_weight, fc2_gemms)
        h, grad_preact = _h_and_grad_preact(saved, grad_h, inplace)
        grad_w2 = grad_weight(grad_y, h, fc2_gemms) if ctx.needs_input_grad[3] else None
        del h, grad_h
        grads = drop_h_grads(
            ctx, x, fc1_weight, grad_preact, grad_y, grad_w2,
            input_grad=partial(grad_input, gemms=fc1_gemms),
            weight_grad=partial(grad_weight, gemms=fc1_gemms),
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
