"""The ``save_factors`` impl (seed 002): fc1 in the packed layout, backward factors saved.

Forward keeps, instead of the preactivation, the two factors backward needs, in packed column
order: per chunk j, [up_j * silu'(gate_j) | silu(gate_j)]. Backward then multiplies them by
grad_h in place to get grad_preact, and the two fc1 GEMMs consume it with no unpacking:
grad_x = grad_preact @ W1_packed and grad_W1 = grad_preactᵀ @ x come out packed.

Where Triton runs, forward is cuBLAS fc1 then one kernel that writes h and overwrites the
preactivation with the factors in place, and backward's factor product is a Triton kernel;
elsewhere the same math runs in plain torch with the same saved tensors.
``fused_forward=True`` (power-of-two chunks >= 16) instead runs forward as one wide gated GEMM
with the SwiGLU epilogue, so the preactivation never reaches memory: the same saved tensors
and peak, but on the H200 our Triton GEMM loses more to cuBLAS than the epilogue saves
(save_factors 1.074x the floor with cuBLAS fc1, 1.109x fused:
benchmarks/results/mlp/mlp_all_variants_h200.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swiglu_train.ops.activation import kernels as activation_kernels
from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.eager import eager_op
from swiglu_train.ops.gated import gated_fwd
from swiglu_train.ops.mlp import claim_inplace_backward, refuse_double_backward

try:
    from swiglu_train.kernels import gated_gemm
except ImportError:  # no Triton: the plain-torch path serves
    gated_gemm = None

SECOND_BACKWARD_ERROR_FACTORS = (
    "ParMLP(impl='save_factors' or 'save_factors_quack') ran its backward in place: the saved "
    "factors now hold grad_preact, so a second backward through this graph (retain_graph=True) "
    "would compute garbage. Build the layer with inplace=False to backpropagate more than once."
)
SECOND_BACKWARD_FREED_ERROR_FACTORS = (
    "ParMLP(impl='save_factors' or 'save_factors_quack'): a second backward through the same "
    "graph, whose saved tensors the first backward freed (it ran without retain_graph=True). "
    "retain_graph=True alone would not help: this impl's backward runs in place and overwrites "
    "the saved factors with grad_preact. To backpropagate more than once, build the layer with "
    "inplace=False and pass retain_graph=True to every backward but the last."
)


def _pairs(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[M, 2F] packed -> [M, F/C, 2, C]: index 0 of dim 2 is the gate chunk, 1 the up chunk."""
    return t.view(t.shape[0], t.shape[1] // (2 * chunk), 2, chunk)  # explicit: M may be 0


def swiglu_packed(preact: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [M, F], factors [M, 2F]) from a packed preactivation.

    h is rounded exactly as ``F.silu(gate) * up`` is, so it equals the other impls' h.
    """
    pairs = _pairs(preact, chunk)
    gate, up = pairs[:, :, 0], pairs[:, :, 1]
    h = (F.silu(gate) * up).reshape(preact.shape[0], preact.shape[1] // 2)
    gate32, up32 = gate.float(), up.float()
    sig = torch.sigmoid(gate32)
    factors = torch.stack([up32 * sig * (1 + gate32 * (1 - sig)), gate32 * sig], dim=2)
    return h, factors.to(preact.dtype).reshape(preact.shape)


@eager_op("swiglu_train::packed_factors_to_grad_", mutates_args=("factors",))
def packed_factors_to_grad_(factors: torch.Tensor, grad_h: torch.Tensor, chunk: int) -> None:
    """factors <- grad_h ⊙ factors, in place, in packed order."""
    gated_gemm.factors_to_grad_(factors, grad_h, chunk)


@packed_factors_to_grad_.register_fake
def _(factors, grad_h, chunk):
    return None


@eager_op("swiglu_train::swiglu_factors_", mutates_args=("preact",))
def swiglu_factors_(preact: torch.Tensor, chunk: int) -> torch.Tensor:
    """h [M, F] from a packed preact, which is overwritten with the backward factors."""
    h = preact.new_empty(preact.shape[0], preact.shape[1] // 2)
    activation_kernels.swiglu_factors_(preact, h, chunk)
    return h


@swiglu_factors_.register_fake
def _(preact, chunk):
    return preact.new_empty(preact.shape[0], preact.shape[1] // 2)


def _fused(x: torch.Tensor, chunk: int) -> bool:
    """Triton runs here and the chunk suits both kernels: a power of two >= 16, since the
    factors kernel's tile spans exactly one chunk."""
    return gated_gemm is not None and triton_enabled(x) and gated_gemm.fused_supported(x, chunk)


class _SaveFactors(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, fc1_weight, fc1_bias, chunk: int, inplace: bool, fused_forward: bool
    ) -> torch.Tensor:
        if fused_forward and _fused(x, chunk):
            h, factors = gated_fwd(x, fc1_weight, fc1_bias, chunk, "factors")
        elif triton_enabled(x):
            factors = F.linear(x, fc1_weight, fc1_bias)
            h = swiglu_factors_(factors, chunk)
        else:
            h, factors = swiglu_packed(F.linear(x, fc1_weight, fc1_bias), chunk)
        ctx.save_for_backward(x, fc1_weight, factors)
        ctx.chunk, ctx.inplace, ctx.has_bias = chunk, inplace, fc1_bias is not None
        ctx.backward_ran = False
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        refuse_double_backward()
        inplace = claim_inplace_backward(
            ctx, SECOND_BACKWARD_ERROR_FACTORS, SECOND_BACKWARD_FREED_ERROR_FACTORS
        )
        x, fc1_weight, factors = ctx.saved_tensors
        grad_h = grad_h.contiguous()
        grad_preact = factors if inplace else factors.clone()
        if _fused(x, ctx.chunk):
            packed_factors_to_grad_(grad_preact, grad_h, ctx.chunk)
        else:
            grad_h = grad_h.view(grad_h.shape[0], grad_h.shape[1] // ctx.chunk, 1, ctx.chunk)
            _pairs(grad_preact, ctx.chunk).mul_(grad_h)
        need_x, need_w1, need_b1 = ctx.needs_input_grad[:3]
        grad_x = grad_preact @ fc1_weight if need_x else None
        grad_w1 = grad_preact.t() @ x if need_w1 else None
        grad_b1 = grad_preact.sum(0) if need_b1 and ctx.has_bias else None
        return grad_x, grad_w1, grad_b1, None, None, None


def save_factors_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    inplace: bool = True,
    chunk: int = 128,
    fused_forward: bool = False,
) -> torch.Tensor:
    """fc1 weight and bias in the packed layout with this chunk; fc2 saves h as in `normal`.

    ``fused_forward=True``: our gated GEMM instead of cuBLAS fc1 and the in-place factors
    kernel. With no grad to compute, ParMLP and the Megatron adapter take ``ops.inference``.
    """
    h = _SaveFactors.apply(x, fc1_weight, fc1_bias, chunk, inplace, fused_forward)
    return F.linear(h, fc2_weight, fc2_bias)
