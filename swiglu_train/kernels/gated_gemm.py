"""The gated GEMM's launchers: argument checks, output allocation, and the launch of the kernels
in gated_kernels, autotuned or at the tile gated_tiles' rule pins at small M.

On the GPU operands and outputs move through TMA tensor descriptors (TMA stores made the
factors epilogue 1.35x cheaper). The interpreter takes the pointer path with fp32 operands
(its bf16 dot is wrong), which is also the path for operands TMA cannot describe (unaligned
strides).
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from swiglu_train.kernels.gated_autotune import fit_config, set_block_shapes
from swiglu_train.kernels.gated_kernels import _factors_to_grad_kernel, _gated_gemm_kernel
from swiglu_train.kernels.gated_tiles import num_sms, pinned_config
from swiglu_train.kernels.runtime import INTERPRET, SUPPORTED_DTYPES, m_bucket

AUX_KINDS = {"none": 0, "factors": 1, "preact": 2}


def fused_supported(x: torch.Tensor, chunk: int) -> bool:
    """The packed kernels need a power-of-two chunk >= 16 (a tl.dot tile edge)."""
    return chunk >= 16 and chunk & (chunk - 1) == 0 and x.dtype in SUPPORTED_DTYPES


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base and row stride (and is a GPU unit)."""
    return (
        not INTERPRET
        and t.is_cuda
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
    )


def gated_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    chunk: int,
    aux: str = "none",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h [M, F], aux [M, 2F] or None) from x [M, K] and fc1 [2F, K] packed with ``chunk``.

    ``chunk == F`` is the canonical [W_gate; W_up]; otherwise ``chunk`` must be a power of two
    >= 16 dividing F. ``aux`` picks the second output: "factors", "preact" or "none".
    """
    if aux not in AUX_KINDS:
        raise ValueError(f"aux must be one of {sorted(AUX_KINDS)}, got {aux!r}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        raise ValueError(
            f"gated GEMM needs x [M, K] and fc1 [2F, K]; got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    m, k = x.shape
    f = weight.shape[0] // 2
    if chunk != f and (f % chunk or not fused_supported(x, chunk)):
        raise ValueError(
            f"chunk {chunk} must be F={f} (canonical) or a power of two >= 16 dividing F"
        )
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"gated GEMM needs x and fc1 of one dtype in {SUPPORTED_DTYPES}; got "
                        f"{x.dtype} and {weight.dtype}")  # fmt: skip
    if bias is not None and (bias.shape != (2 * f,) or bias.dtype != x.dtype):
        raise ValueError(
            f"fc1 bias must be [{2 * f}] {x.dtype}; got {tuple(bias.shape)} {bias.dtype}"
        )
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError(f"gated GEMM operands must share one device; x is on {x.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    h = x.new_empty(m, f)
    aux_out = x.new_empty(m, 2 * f) if aux != "none" else None
    if m == 0:
        return h, aux_out
    outs = (h, h, h) if aux_out is None else (h, aux_out, aux_out)
    if chunk == f and aux_out is not None:  # canonical: gate and up halves, clipped at F
        outs = (h, aux_out[:, :f], aux_out[:, f:])
    use_tma = all(_tma_ok(t) for t in (x, weight, *outs))
    if use_tma:  # boxes are set per config by set_block_shapes
        x_arg, w_arg, *out_args = (
            TensorDescriptor.from_tensor(t, [16, 16]) for t in (x, weight, *outs)
        )
    else:
        x_arg, w_arg, out_args = x, weight, list(outs)
    programs = num_sms(x.device.index or 0) if x.is_cuda else 1

    def grid(meta: dict) -> tuple[int]:
        tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(f, meta["BLOCK_N"])
        return (min(tiles, programs) if meta["PERSISTENT"] else tiles,)

    bias_arg = bias if bias is not None else weight
    aux_stride = aux_out.stride(0) if aux_out is not None else 0
    args = (x_arg, w_arg, bias_arg, *out_args, m, k, f, x.stride(0), weight.stride(0),
            h.stride(0), aux_stride, m_bucket(m))  # fmt: skip
    constexprs = {
        "HAS_BIAS": bias is not None,
        "AUX": AUX_KINDS[aux],
        "CHUNK": chunk,
        "USE_TMA": use_tma,
        "UPCAST": INTERPRET,
        "IEEE": x.dtype == torch.float32,
    }
    pinned = pinned_config(x, f, chunk, aux, has_bias=bias is not None, use_tma=use_tma)
    if pinned is None:
        _gated_gemm_kernel[grid](*args, **constexprs)
    else:  # the rule's tile, launched as the autotuner launches its pick
        pinned = fit_config(pinned, chunk, True, x.element_size())
        named = dict(zip(_gated_gemm_kernel.arg_names, args, strict=False))
        set_block_shapes({**named, **constexprs, **pinned.kwargs})
        _gated_gemm_kernel.fn[grid](*args, **constexprs, **pinned.all_kwargs())
    return h, aux_out


def factors_to_grad_(factors: torch.Tensor, grad_h: torch.Tensor, chunk: int) -> None:
    """Overwrite the saved factors with grad_preact = grad_h ⊙ factors (packed order)."""
    m, rows = factors.shape
    if grad_h.shape != (m, rows // 2) or grad_h.dtype != factors.dtype:
        raise ValueError(
            f"grad_h {tuple(grad_h.shape)} {grad_h.dtype} does not match factors "
            f"{tuple(factors.shape)} {factors.dtype}"
        )
    if m == 0:
        return
    block_m = 16 if INTERPRET else 32
    grid = (-(-m // block_m), rows // (2 * chunk))  # not triton.cdiv: ~3 us of host time a call
    _factors_to_grad_kernel[grid](
        factors, grad_h, m, factors.stride(0), grad_h.stride(0), CHUNK=chunk, BLOCK_M=block_m
    )
