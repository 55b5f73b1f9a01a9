"""The float8 operands of drop_h's FP8 GEMMs, cast as a torchao ``Float8Linear``'s recipe says.

Each GEMM casts its two operands (e4m3 or e5m2, tensorwise or rowwise scales, as the linear's
``Float8LinearConfig`` says for that GEMM's role). The bytes are always torchao's:

- **Where Triton runs, outside torch.compile,** two passes of ``kernels.float8_cast`` (the amax,
  then the bytes in the layout ``torch._scaled_mm`` takes) with torchao's ``amax_to_scale``
  between them: its bytes in one launch (``scale_of``), or torchao's own five ops where the
  recipe rounds scales to powers of two. torchao's eager cast is six full-size kernels and,
  for half the operands, a copy into that layout.
- **Elsewhere** torchao's own ``hp_tensor_to_float8_dynamic`` (inductor fuses it under
  torch.compile; DTensors and other subclasses are torchao's to handle).

**One read for two casts.** A step casts x, both weights, grad_y and grad_preact twice each,
for two GEMMs that contract different dims. Where both casts scale tensorwise, their amax is
the same number: ``shared_amax`` finds it once (in forward for x and the weights, kept for
backward as a 0-dim fp32 tensor), and each cast takes it, so the second skips its full read.
Where both scale rowwise, one read finds the per-row amaxes of one cast and the per-column
amaxes of the other (``kernels.float8_cast.amax_both``); forward keeps backward's share (a
vector of D or F floats each) for backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from swiglu_train.kernels.fp8_format import MIN_CAPABILITY
from swiglu_train.kernels.runtime import device_capability
from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.eager import eager_op

try:
    from swiglu_train.kernels import float8_cast as cast_kernels
except ImportError:  # no Triton on this platform: torchao casts
    cast_kernels = None

PLAIN_TENSORS = (torch.Tensor, nn.Parameter)  # no subclass whose ops reroute
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


def fp8_kernels_run(t: torch.Tensor) -> bool:
    """Whether Triton's fp8 conversions compile for ``t``'s device (sm_89+, or the CPU's
    interpreter): below that, torchao's ``emulate`` recipes still cast in torch."""
    return not t.is_cuda or device_capability(t.get_device()) >= MIN_CAPABILITY


def fused_cast_runs(t: torch.Tensor) -> bool:
    """Whether ``kernels.float8_cast`` casts ``t``: a plain non-empty 2D tensor or parameter
    (not a DTensor or another subclass, whose cast torchao handles) where Triton runs, outside
    torch.compile (whose inductor fuses torchao's cast itself)."""
    return (
        cast_kernels is not None
        and type(t) in PLAIN_TENSORS
        and t.dim() == 2
        and t.numel() > 0
        and not torch.compiler.is_compiling()
        and triton_enabled(t)
        and fp8_kernels_run(t)
    )


class TorchaoFloat8(NamedTuple):
    """torchao's float8 names that the casts use, imported once (``torchao_float8``)."""

    ScalingGranularity: type
    ScalingType: type
    GemmInputRole: type
    Float8TrainingTensor: type
    get_maybe_axiswise_dim: Callable
    hp_tensor_to_float8_dynamic: Callable
    hp_tensor_and_scale_to_float8: Callable
    tensor_already_casted_to_fp8: Callable
    amax_to_scale: Callable
    tensor_to_amax: Callable
    to_fp8_saturated: Callable


_TORCHAO: TorchaoFloat8 | None = None


def torchao_float8() -> TorchaoFloat8:
    """torchao's float8 names, imported on the first FP8 GEMM (torchao is the ``fp8`` extra, and
    slow to import) and kept: a step casts a dozen operands, each asking for them. A NamedTuple,
    which torch.compile traces: the first call may come inside a compiled block, where building
    a SimpleNamespace broke the graph, and the FP8 MLP then ran uncompiled in it."""
    global _TORCHAO
    if _TORCHAO is None:
        from torchao.float8 import config, float8_scaling_utils, float8_training_tensor
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax, to_fp8_saturated

        _TORCHAO = TorchaoFloat8(
            config.ScalingGranularity,
            config.ScalingType,
            float8_training_tensor.GemmInputRole,
            float8_training_tensor.Float8TrainingTensor,
            float8_scaling_utils.get_maybe_axiswise_dim,
            float8_scaling_utils.hp_tensor_to_float8_dynamic,
            float8_training_tensor.hp_tensor_and_scale_to_float8,
            tensor_already_casted_to_fp8,
            amax_to_scale,
            tensor_to_amax,
            to_fp8_saturated,
        )
    return _TORCHAO


def dynamic_granularity(gemms: Float8Gemms | None, *casts: str) -> str | None:
    """ "tensorwise" or "axiswise" where every cast named (``Float8LinearConfig`` attributes,
    such as ``cast_config_input``) scales dynamically at that one granularity; else None."""
    if gemms is None:
        return None
    ao = torchao_float8()
    found = set()
    for name in casts:
        cast = getattr(gemms.config, name)
        if cast.scaling_type is not ao.ScalingType.DYNAMIC:
            return None
        found.add(cast.scaling_granularity)
    if len(found) != 1:
        return None
    return "axiswise" if found.pop() is ao.ScalingGranularity.AXISWISE else "tensorwise"


Amax = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


def shared_amax(t: torch.Tensor, gemms: Float8Gemms | None, *casts: str) -> Amax:
    """``t``'s amaxes for the two casts named (``Float8LinearConfig`` attributes of two GEMMs
    that contract ``t``'s two dims, as a linear's casts of x, weightᵀ and the gradient do),
    found in one read: where both scale dynamically tensorwise, the amax over all
    of ``t``, which both take; where both scale per row or column (rowwise) and the fused
    kernels run, (per row [R, 1], per column [1, C]), one for each (``along``). None otherwise:
    each cast then finds its own."""
    if gemms is None or t.numel() == 0 or torchao_float8().tensor_already_casted_to_fp8(t):
        return None
    granularity = dynamic_granularity(gemms, *casts)
    if granularity == "axiswise" and fused_cast_runs(t):
        return cast_kernels.amax_both(t)
    if granularity != "tensorwise":
        return None
    if fused_cast_runs(t):
        return cast_kernels.amax(t, -1, rowwise=False)
    return torchao_float8().tensor_to_amax(t).float()  # fp32 as the kernel's: 4 bytes kept each


def along(amax: Amax, dim: int) -> torch.Tensor | None:
    """What of ``shared_amax``'s result the cast contracting ``dim`` takes: the tensorwise amax
    itself, or of a (per row, per column) pair the per-row amaxes for the last dim and the
    per-column ones for the first."""
    if isinstance(amax, tuple):
        return amax[1] if dim % 2 == 0 else amax[0]
    return amax


def cast_operand(
    t: torch.Tensor,
    cast_config,
    role: str,
    dim: int,
    gemms: Float8Gemms,
    amax: torch.Tensor | None = None,
    after: torch.Tensor | None = None,
):
    """``t`` as the float8 operand of one GEMM contracting its ``dim``, or itself where the
    recipe leaves it unscaled or it arrives cast already (FSDP2's float8 all-gather of the
    weights). ``amax``: its amax, found already (by ``shared_amax``, or by the kernel that wrote
    ``t``), tensorwise or, for an axiswise cast, along ``dim`` with keepdim.

    ``after``: for a backward cast of a tensor that is alive anyway (x, for grad_W1), a tensor
    of backward's (grad_preact). Under torch.compile the partitioner moved that cast into
    forward, whose inputs it has, and kept its fp8 bytes for backward (M·D bytes a layer, 32 MiB
    at Llama-3-8B's M = 8000) beside the bf16 x: cast in an opaque op that also takes ``after``,
    it can only run in backward, from x."""
    ao = torchao_float8()
    if cast_config.scaling_type is ao.ScalingType.DISABLED or ao.tensor_already_casted_to_fp8(t):
        return t
    granularity, dtype = cast_config.scaling_granularity, cast_config.target_dtype
    axiswise_dim = ao.get_maybe_axiswise_dim(dim, granularity)
    round_pow2 = gemms.config.round_scales_to_power_of_2
    role = getattr(ao.GemmInputRole, role)
    fused = fused_cast_runs(t)
    opaque = after is not None and torch.compiler.is_compiling()
    if amax is None and not (fused or opaque):
        return ao.hp_tensor_to_float8_dynamic(
            t, dtype, gemms.mm_config, gemm_input_role=role, scaling_granularity=granularity,
            axiswise_dim=axiswise_dim, round_scales_to_power_of_2=round_pow2,
        )  # fmt: skip
    if amax is None and fused:
        amax = cast_kernels.amax(t, dim, granularity is ao.ScalingGranularity.AXISWISE)
    elif amax is None:  # torchao's own amax, as hp_tensor_to_float8_dynamic finds it
        amax = ao.tensor_to_amax(t, scaling_granularity=granularity, axiswise_dim=axiswise_dim)
    scale = scale_of(amax, dtype, round_pow2, fused)
    if not (fused or opaque):
        return ao.hp_tensor_and_scale_to_float8(
            t, scale, dtype, gemms.mm_config, role, axiswise_dim
        )
    data = float8_cast_bytes(t, scale, dim, dtype, after)
    return ao.Float8TrainingTensor(data, scale, t.dtype, gemms.mm_config, role, axiswise_dim)


def scale_of(amax: torch.Tensor, dtype: torch.dtype, round_pow2: bool, fused: bool):
    """torchao's scale of ``amax``: its five kernels in one where the fused casts run and the
    recipe does not round scales to powers of two (``kernels.float8_cast.amax_to_scale``), else
    torchao's own ``amax_to_scale``, which inductor fuses under torch.compile."""
    if fused and not round_pow2:
        return cast_kernels.amax_to_scale(amax, dtype)
    return torchao_float8().amax_to_scale(amax, dtype, round_pow2)


@eager_op("swiglu_train::float8_cast_bytes", mutates_args=())
def float8_cast_bytes(
    t: torch.Tensor,
    scale: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """``t`` (2D) scaled and cast to ``dtype`` as torchao casts it, laid out with ``dim``
    contiguous, as ``_scaled_mm`` takes it: ``kernels.float8_cast.cast`` where it runs, else
    torchao's own arithmetic. An op torch.compile keeps opaque; ``after`` is read by nothing
    but orders it after that tensor (``cast_operand``)."""
    if fused_cast_runs(t):
        return cast_kernels.cast(t, scale, dim, dtype)
    data = torchao_float8().to_fp8_saturated(t.float() * scale, dtype)
    return data.contiguous() if dim % 2 == 1 else data.t().contiguous().t()


@float8_cast_bytes.register_fake
def _(t, scale, dim: int, dtype: torch.dtype, after=None) -> torch.Tensor:
    if dim % 2 == 1:
        return t.new_empty(t.shape, dtype=dtype)
    return t.new_empty(t.shape[::-1], dtype=dtype).t()
