"""The no-grad forward that every ParMLP impl takes (seeds 003 and 004): nothing is saved.

:func:`swiglu_mlp_inference` picks one of three paths by shape (:func:`inference_path`):
  "fused_mlp"  seed 004's fully fused MLP, h never in HBM; canonical fc1 and small M only, where
               the MLP is bound by reading its weights and one pass over them wins;
  "gated"      the gated GEMM (fc1 with the SwiGLU epilogue, seed 003), then cuBLAS for fc2;
               either fc1 layout, up to GATED_MAX_M rows when canonical;
  "cublas"     canonical fc1 beyond GATED_MAX_M rows: cuBLAS fc1, our activation kernel,
               cuBLAS fc2, which is what wins at training sizes (the no-grad forward of
               reentrant activation checkpointing lands here);
  "torch"      plain torch, where Triton cannot run (or under ``use_backend("torch")``), and
               on CPU beyond INTERPRETER_MAX_M rows: the interpreter runs kernels at Python
               speed (the gated GEMM takes 3.4 s for 256x64 -> 160), fit for tests, not models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swiglu_train.ops.activation import swiglu_fwd, triton_enabled
from swiglu_train.ops.gated import gated_enabled, gated_fwd

try:
    from swiglu_train.kernels import fused_mlp as fused_kernels
except ImportError:  # no Triton: the gated and torch paths decide alone
    fused_kernels = None

# Largest M at which the fully fused MLP beats the gated GEMM + cuBLAS fc2, per (D, F).
# Not measured yet: every shape takes DEFAULT_FUSED_MLP_MAX_M until the H200 numbers of
# `swiglu-train bench-inference` (which prints the entries it suggests) replace this.
FUSED_MLP_MAX_M: dict[tuple[int, int], int] = {}
DEFAULT_FUSED_MLP_MAX_M = 16
# Above this M, cuBLAS fc1 + the activation kernel beats our Triton gated GEMM: measured on the
# H200 at Qwen-7B (tie at 4096, cuBLAS +6 % ahead at 11136; benchmarks/results/
# tune_gated_h200.json). A packed fc1 has no cuBLAS-side activation, so it stays gated.
GATED_MAX_M = 4096
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


def fused_mlp_max_m(hidden_size: int, ffn_size: int) -> int:
    """The measured crossover for this shape, or the default where none was measured."""
    return FUSED_MLP_MAX_M.get((hidden_size, ffn_size), DEFAULT_FUSED_MLP_MAX_M)


def inference_path(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, chunk: int | None
) -> str:
    """The path for this call (fused_mlp, gated or torch); ``chunk``: packed fc1's, or None."""
    (m, d), f = x.shape, fc1_weight.shape[0] // 2
    fusable = (
        chunk is None
        and fused_kernels is not None
        and _kernels_serve(x)
        and m <= fused_mlp_max_m(d, f)
        and fc1_weight.stride(1) == 1
        and fc2_weight.stride(1) == 1
    )
    if fusable:
        return "fused_mlp"
    if chunk is None and m > GATED_MAX_M and _kernels_serve(x):
        return "cublas"
    return "gated" if _gated_serves(x, chunk, f) else "torch"


def _kernels_serve(x: torch.Tensor) -> bool:
    """Triton runs here, and (on CPU, interpreted) the call is test-sized."""
    return triton_enabled(x) and (x.device.type != "cpu" or x.shape[0] <= INTERPRETER_MAX_M)


def _gated_serves(x: torch.Tensor, chunk: int | None, ffn_size: int) -> bool:
    """The gated GEMM takes this layout (canonical, or a power-of-two chunk >= 16) here."""
    return _kernels_serve(x) and gated_enabled(x, chunk or ffn_size, ffn_size)


def swiglu_gated_inference(
    x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, chunk: int | None
) -> torch.Tensor:
    """h [M, F] with no grad: the gated GEMM where it runs, else the same math in torch."""
    f = fc1_weight.shape[0] // 2
    if _gated_serves(x, chunk, f):
        return gated_fwd(x, fc1_weight, fc1_bias, chunk or f, "none")[0]
    preact = F.linear(x, fc1_weight, fc1_bias)
    pairs = preact.view(x.shape[0], -1, 2, chunk or f)  # [gate_j | up_j] pairs; one if canonical
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
    path = inference_path(x2d, fc1_weight, fc2_weight, chunk)
    if path == "fused_mlp":
        return fused_mlp(x2d, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
    if path == "cublas":
        h = swiglu_fwd(F.linear(x2d, fc1_weight, fc1_bias))
    else:
        h = swiglu_gated_inference(x2d, fc1_weight, fc1_bias, chunk)
    return F.linear(h, fc2_weight, fc2_bias)
