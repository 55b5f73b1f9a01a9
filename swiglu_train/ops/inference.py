"""The no-grad forward that every ParMLP impl takes (seeds 003 and 004): nothing is saved.

:func:`swiglu_mlp_inference` picks one of these paths by shape (:func:`inference_path`), from the
"mlp" entries of the measured dispatch table (``ops.dispatch``, which also holds the rules that
apply where the table has no entry):
  "fused_mlp"  seed 004's fully fused MLP, h never in HBM; canonical fc1 and small M, where
               the MLP is bound by reading its weights and one pass over them wins;
  "gated"      the gated GEMM (fc1 with the SwiGLU epilogue, seed 003), then cuBLAS for fc2;
               the only kernel path of a packed fc1, whose pairs no other kernel reads;
  "cublas"     canonical fc1 at large M: cuBLAS fc1, our activation kernel, cuBLAS fc2, which
               is what wins at training sizes (the no-grad forward of reentrant activation
               checkpointing lands here);
  "quack"      canonical fc1 where the table measured quack's GEMM with the SwiGLU epilogue
               fastest (then cuBLAS fc2); where quack cannot serve, the entry's fallback.
               Always for fc1 packed with chunk 1 (save_factors_quack's layout, quack's own
               pair order) where quack can serve;
  "torch"      plain torch, where Triton cannot run (or under ``use_backend("torch")``), and
               on CPU beyond INTERPRETER_MAX_M rows: the interpreter runs kernels at Python
               speed (the gated GEMM takes 3.4 s for 256x64 -> 160), fit for tests, not models.
               Also wherever forward-mode AD tracks a tangent (``torch.func.jvp``, jacfwd,
               ``forward_ad`` dual tensors): no kernel has a forward derivative, and a custom
               op without one would return the tangent as zero, silently.
:func:`swiglu_gated_projection` computes h alone the same way, from the table's "gated" entries.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from swiglu_train.ops import dispatch
from swiglu_train.ops.activation import swiglu_fwd, triton_enabled
from swiglu_train.ops.gated import gated_enabled, gated_fwd
from swiglu_train.ops.quack_mlp import quack_serves, quack_swiglu_projection
from swiglu_train.ops.quack_save_factors import CHUNK as INTERLEAVED  # quack's own pair order

try:
    from swiglu_train.kernels import fused_mlp as fused_kernels
except ImportError:  # no Triton: the gated and torch paths decide alone
    fused_kernels = None

INTERPRETER_MAX_M = 64


@torch.library.custom_op("swiglu_train::fused_mlp", mutates_args=())
def fused_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
) -> torch.Tensor:
    """y [M, O] of the SwiGLU MLP in one kernel pass over canonical weights (seed 004)."""
    return fused_kernels.fused_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias)


@fused_mlp.register_fake
def _(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    return x.new_empty(x.shape[0], fc2_weight.shape[0])


def grad_needed(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call: grad mode is on and some input requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def tangents_present(*tensors: torch.Tensor | None) -> bool:
    """Whether forward-mode AD tracks a tangent through this call (``torch.func.jvp``, jacfwd,
    ``forward_ad`` dual tensors). Nothing requires grad there, so the no-grad path serves it,
    and only plain torch ops carry the tangent: our kernels have no forward derivative."""
    if _dual_level() < 0:  # no dual level entered: no tensor can carry a tangent
        return False
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def transforms_need_torch(*tensors: torch.Tensor | None) -> bool:
    """Whether only plain torch ops can serve this call: forward-mode AD carries a tangent
    (:func:`tangents_present`), or a ``torch.func`` transform (grad, vmap, jacrev, ...) is
    active, through which neither our autograd Functions (no ``setup_context``) nor our custom
    ops (no batching rule) run. Not asked while torch.compile traces: it sees no transform."""
    if tangents_present(*tensors):
        return True
    if torch.compiler.is_compiling() or _peek_interpreter_stack is None:
        return False
    return _peek_interpreter_stack() is not None


def _dual_level() -> int:
    """forward_ad's current dual level (-1: none entered). It is private: a torch without it
    reads as "maybe entered", and each tensor's tangent is then looked up."""
    return getattr(fwAD, "_current_level", 0)


# The functorch transform stack's top, private too: a torch without it runs the kernels under a
# transform, which then fails loudly (no setup_context, no batching rule), not silently.
_peek_interpreter_stack = getattr(
    getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None
)


def swiglu_mlp_torch(
    x2d: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    chunk: int | None,
) -> torch.Tensor:
    """y [M, O] in plain torch ops for fc1 in any layout: differentiable every way, by autograd,
    forward-mode AD and ``torch.func``, and saving what eager saves."""
    return F.linear(_gated_torch(x2d, fc1_weight, fc1_bias, chunk), fc2_weight, fc2_bias)


def inference_path(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, chunk: int | None
) -> str:
    """The MLP's path for this call (fused_mlp, gated, cublas, quack or torch); ``chunk``: packed
    fc1's, or None. Where the table's fused_mlp cannot serve (weights not row-major), gated does."""
    (m, d), f = x.shape, fc1_weight.shape[0] // 2
    if chunk == INTERLEAVED and quack_serves(x, fc1_weight):
        return "quack"
    if chunk is None and _kernels_serve(x):
        path = dispatch.choose("mlp", d, f, m, lambda: quack_serves(x, fc1_weight))
        fusable = (
            fused_kernels is not None and fc1_weight.stride(1) == 1 and fc2_weight.stride(1) == 1
        )
        if path in ("cublas", "quack") or (path == "fused_mlp" and fusable):
            return path
    return "gated" if _gated_serves(x, chunk, f) else "torch"


def projection_path(x: torch.Tensor, fc1_weight: torch.Tensor, chunk: int | None) -> str:
    """The path for h alone (gated, cublas, quack or torch), from the table's "gated" entries."""
    (m, d), f = x.shape, fc1_weight.shape[0] // 2
    if chunk == INTERLEAVED and quack_serves(x, fc1_weight):
        return "quack"
    if chunk is None and _kernels_serve(x):
        path = dispatch.choose("gated", d, f, m, lambda: quack_serves(x, fc1_weight))
        if path in ("cublas", "quack"):
            return path
    return "gated" if _gated_serves(x, chunk, f) else "torch"


def _kernels_serve(x: torch.Tensor) -> bool:
    """Triton runs here, and (on CPU, interpreted) the call is test-sized."""
    return triton_enabled(x) and (x.device.type != "cpu" or x.shape[0] <= INTERPRETER_MAX_M)


def _gated_serves(x: torch.Tensor, chunk: int | None, ffn_size: int) -> bool:
    """The gated GEMM takes this layout (canonical, or a power-of-two chunk >= 16) here."""
    return _kernels_serve(x) and gated_enabled(x, chunk or ffn_size, ffn_size)


def swiglu_gated_projection(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, chunk: int | None
) -> torch.Tensor:
    """h [M, F] with no grad on the fastest path for this shape (:func:`projection_path`)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if tangents_present(x, fc1_weight, fc1_bias):
        path = "torch"
    else:
        path = projection_path(x, fc1_weight, chunk)
    if path == "cublas":
        return swiglu_fwd(F.linear(x, fc1_weight, fc1_bias))
    if path == "quack":
        return quack_swiglu_projection(x, fc1_weight, fc1_bias, chunk == INTERLEAVED)
    if path == "gated":
        return swiglu_gated_inference(x, fc1_weight, fc1_bias, chunk)
    return _gated_torch(x, fc1_weight, fc1_bias, chunk)


def swiglu_gated_inference(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, chunk: int | None
) -> torch.Tensor:
    """h [M, F] with no grad: the gated GEMM where it runs, else the same math in torch. The
    "gated" path of the entry points above, which send forward-mode AD to "torch" first."""
    f = fc1_weight.shape[0] // 2
    if _gated_serves(x, chunk, f):
        return gated_fwd(x, fc1_weight, fc1_bias, chunk or f, "none")[0]
    return _gated_torch(x, fc1_weight, fc1_bias, chunk)


def _gated_torch(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, chunk: int | None
) -> torch.Tensor:
    """h [M, F] in plain torch ops (the "torch" path), for any layout; autograd and forward-mode
    AD see through it."""
    f = fc1_weight.shape[0] // 2
    preact = F.linear(x, fc1_weight, fc1_bias)
    chunk = chunk or f  # [gate_j | up_j] pairs; one if canonical
    pairs = preact.view(x.shape[0], f // chunk, 2, chunk)  # explicit sizes: M may be 0
    return (F.silu(pairs[:, :, 0]) * pairs[:, :, 1]).reshape(x.shape[0], f)


def swiglu_mlp_inference(
    x2d: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    chunk: int | None,
) -> torch.Tensor:
    """y [M, O] of the SwiGLU MLP on the fastest path for this shape, saving nothing.

    ``chunk`` is the packed fc1 layout's chunk, or None for the canonical [W_gate; W_up].
    """
    x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    if tangents_present(x2d, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        path = "torch"
    else:
        path = inference_path(x2d, fc1_weight, fc2_weight, chunk)
    if path == "fused_mlp":
        return fused_mlp(x2d, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    if path == "cublas":
        h = swiglu_fwd(F.linear(x2d, fc1_weight, fc1_bias))
    elif path == "quack":
        h = quack_swiglu_projection(x2d, fc1_weight, fc1_bias, chunk == INTERLEAVED)
    elif path == "gated":
        h = swiglu_gated_inference(x2d, fc1_weight, fc1_bias, chunk)
    else:
        h = _gated_torch(x2d, fc1_weight, fc1_bias, chunk)
    return F.linear(h, fc2_weight, fc2_bias)
