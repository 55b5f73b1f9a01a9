"""The FP8 format of drop_h's saved preactivation: constants shared by the kernels and ops.

A [M, 2F] preactivation is stored as float8_e4m3fn values [M, 2F] plus bf16 scales
[M, 2 * n_blocks(F)]. Each half (gate, up) of each row is cut into blocks of ``BLOCK``
columns; the last block of a half is partial when F % BLOCK != 0, and no block straddles the
gate/up boundary. Scale column ``b`` is gate block ``b`` and column ``n_blocks(F) + b`` is up
block ``b``. A block's scale is amax / 448 rounded up to bf16 (``round_up_bf16``): the block
max lands within 2**-7 of 448, and the scale takes 2 bytes instead of fp32's 4. Why this
format, and what it costs: ``swiglu_train.ops.fp8_saved``.

No Triton here, so the plain-torch path imports it where Triton is absent.
"""

from __future__ import annotations

import torch

BLOCK = 128  # columns per scale (DeepSeek-V3's 1x128 activation tiles)
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
# A block's amax is raised to this before the scale is taken: the scale amax / 448 is a normal
# float (2**-126, a bf16 too), so an all-zero or all-subnormal block never divides by zero or
# makes 0 * inf; its values still come back to within the block's rounding.
MIN_AMAX = E4M3_MAX * 2.0**-126
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.bfloat16
# Restored values saturate here: a block max within 2**-7 of fp32's max times a scale rounded
# up by as much may pass it (the kernels and ``restore`` clamp, propagating NaN).
FP32_MAX = torch.finfo(torch.float32).max
# The kernels convert to and from Triton's float8e4nv (e4m3), which Triton's CUDA backend
# compiles for compute capability 8.9 (Ada) and up only (fp8e4nv joins its supported fp8 types
# at sm_89); below that the first launch would fail to compile, mid-step.
MIN_CAPABILITY = (8, 9)


def round_up_bf16(scale: torch.Tensor) -> torch.Tensor:
    """Positive fp32 scales rounded up to the next bf16 (as fp32 whose low 16 bits are 0), so
    that the block max over its scale stays at most 448; NaN and inf stay as they are."""
    bits = scale.view(torch.int32)
    up = (bits & 0xFFFF != 0).to(torch.int32) << 16
    rounded = ((bits & -65536) + up).view(torch.float32)
    return torch.where(scale.isnan(), scale, rounded)


def restore(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 values (as fp32) times their blocks' scales (broadcast), saturated at FP32_MAX:
    what the kernels' dequantization computes."""
    return (values * scales).clamp(-FP32_MAX, FP32_MAX)  # NaN stays NaN


def n_blocks(ffn: int) -> int:
    """Scale blocks per half of a row (the last one partial when BLOCK does not divide F)."""
    return -(-ffn // BLOCK)


def saved_shapes(m: int, ffn: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the FP8 values and of their scales for a [m, 2 * ffn] preactivation."""
    return (m, 2 * ffn), (m, 2 * n_blocks(ffn))


def copy_bytes(m: int, ffn: int) -> int:
    """Bytes of the FP8 copy of a [m, 2F] preactivation and its scales."""
    values, scales = saved_shapes(m, ffn)
    return values[0] * values[1] * FP8_DTYPE.itemsize + scales[0] * scales[1] * SCALE_DTYPE.itemsize


# The paired format (drop_h_quack's): the copy keeps quack's column order, gate and up of each
# feature side by side ([g0, u0, g1, u1, ...]), and one bf16 scale covers PAIRED_GROUP adjacent
# columns, 64 features' gate and up values. quack's GEMM epilogue folds a max over adjacent
# accumulator columns only, so its groups cannot hold one half alone (kernels.quack_fp8_epilogues).
PAIRED_GROUP = 128


def paired_saved_shapes(m: int, ffn: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the paired format's values and scales for a [m, 2 * ffn] preactivation; F
    must be a multiple of PAIRED_GROUP / 2 (no group is partial)."""
    if (2 * ffn) % PAIRED_GROUP:
        raise ValueError(
            f"the paired FP8 format needs F a multiple of {PAIRED_GROUP // 2}, got F={ffn}"
        )
    return (m, 2 * ffn), (m, 2 * ffn // PAIRED_GROUP)


def capability_error(capability: tuple[int, int], device: str) -> str | None:
    """Why the FP8 kernels cannot run on ``device`` of this compute capability, or None."""
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"saved_fp8=True needs a GPU with FP8 (e4m3) support, compute capability "
        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (Ada, Hopper or newer): its Triton kernels "
        f"store float8e4nv, which Triton compiles for sm_89 and up only; {device} is "
        f"{major}.{minor}. Leave saved_fp8 off there (drop_h keeps its preactivation in bf16)"
    )
