"""What the inference benchmark races: forward-only callables ``(x, weights) -> output``.

Two tables. "gated": fc1 and the SwiGLU activation, x [M, D] -> h [M, F]. "mlp": the whole
MLP, x -> y [M, D]. Each table's first variant is its eager reference, which every other
output is checked against; ``gemm_only`` is each table's floor (its GEMMs with no activation),
whose output is not comparable and is not checked. Peers are imported when built: one that does
not import is reported as skipped with the reason.

``ours`` is the dispatched path; the candidates it dispatches among are timed on their own
(CANDIDATES), and the fastest of them at each shape is what the dispatch table records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiglu_train.ops import inference, reference
from swiglu_train.ops.activation import swiglu_fwd
from swiglu_train.ops.quack_mlp import quack_swiglu_projection, require_quack

COMPILE_MODE = "default"  # cuBLAS GEMMs + fused Triton pointwise; max-autotune costs minutes


@dataclass
class Weights:
    """One layer's canonical weights: fc1 [2F, D] = [W_gate; W_up] and fc2 [D, F]."""

    fc1: torch.Tensor
    fc2: torch.Tensor

    @classmethod
    def random(cls, d: int, f: int, dtype: torch.dtype, device: str) -> Weights:
        fc1 = torch.randn(2 * f, d, device=device, dtype=dtype) / d**0.5
        return cls(fc1, torch.randn(d, f, device=device, dtype=dtype) / f**0.5)

    @property
    def ffn(self) -> int:
        return self.fc2.shape[1]


Variant = Callable[[torch.Tensor, Weights], torch.Tensor]


def _eager_separate(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """HF Llama's MLP: two GEMMs (gate_proj, up_proj) then ``F.silu(gate) * up``."""
    return F.silu(F.linear(x, w.fc1[: w.ffn])) * F.linear(x, w.fc1[w.ffn :])


def _eager_fused(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """Megatron's: one fc1 GEMM into [gate | up] then ``F.silu(gate) * up``."""
    return reference.swiglu(F.linear(x, w.fc1))


def _eager_mlp(x: torch.Tensor, w: Weights) -> torch.Tensor:
    return reference.mlp(x, w.fc1, None, w.fc2, None)


def _liger() -> Variant:
    """Liger's SiLU-mul after the fused fc1 GEMM; its [gate | up] form where it has one (no
    contiguous copies of the halves), else LigerSiLUMulFunction on the two halves."""
    try:
        from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction as Fused
    except ImportError:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return lambda x, w: LigerSiLUMulFunction.apply(*F.linear(x, w.fc1).chunk(2, dim=-1))
    return lambda x, w: Fused.apply(F.linear(x, w.fc1), False)


def _quack_gated() -> Variant:
    """quack's GEMM with the gated activation in its epilogue, reading [W_gate; W_up]."""
    from quack.linear import linear_gated_func

    def run(x: torch.Tensor, w: Weights) -> torch.Tensor:
        return linear_gated_func(x, w.fc1, "swiglu", store_preact=False, tuned=False,
                                 concat_layout=True)[1]  # fmt: skip

    return run


def _quack_mlp() -> Variant:
    from quack.mlp import mlp_func

    return lambda x, w: mlp_func(x, w.fc1, w.fc2, activation="swiglu", tuned=False,
                                 concat_layout=True)  # fmt: skip


def _quack_projection() -> Variant:
    """Our "quack" dispatch path alone: quack's gated GEMM, no preactivation stored."""
    require_quack()  # not importable: the bench reports this candidate skipped
    return lambda x, w: quack_swiglu_projection(x, w.fc1, None)


def _quack_projection_linear() -> Variant:
    projection = _quack_projection()
    return lambda x, w: F.linear(projection(x, w), w.fc2)


def _cublas_act(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """cuBLAS fc1, then our activation kernel on its [gate | up] output."""
    return swiglu_fwd(F.linear(x, w.fc1))


def _compiled(fn: Variant) -> Callable[[], Variant]:
    """A fresh torch.compile per model (dynamic=False: one graph per M, as served shapes are)."""
    return lambda: torch.compile(fn, mode=COMPILE_MODE, dynamic=False)


GATED: dict[str, Callable[[], Variant]] = {
    "eager_fused": lambda: _eager_fused,
    "eager_separate": lambda: _eager_separate,
    "compile": _compiled(_eager_fused),
    "liger": _liger,
    "quack": _quack_gated,
    "ours": lambda: lambda x, w: inference.swiglu_gated_projection(x, w.fc1, None, None),
    "gated_triton": lambda: lambda x, w: inference.swiglu_gated_inference(x, w.fc1, None, None),
    "cublas_act": lambda: _cublas_act,
    "quack_act": _quack_projection,
    "gemm_only": lambda: lambda x, w: F.linear(x, w.fc1),
}
MLP: dict[str, Callable[[], Variant]] = {
    "eager": lambda: _eager_mlp,
    "compile": _compiled(_eager_mlp),
    "quack": _quack_mlp,
    "ours": lambda: lambda x, w: inference.swiglu_mlp_inference(x, w.fc1, None, w.fc2, None, None),
    "fused_mlp": lambda: lambda x, w: inference.fused_mlp(x, w.fc1, None, w.fc2, None),
    "gated_linear": lambda: (
        lambda x, w: F.linear(inference.swiglu_gated_inference(x, w.fc1, None, None), w.fc2)
    ),
    "cublas_act_linear": lambda: lambda x, w: F.linear(_cublas_act(x, w), w.fc2),
    "quack_act_linear": _quack_projection_linear,
    # the two GEMMs alone: fc2 reads the [M, F] left half of fc1's output in place
    "gemm_only": lambda: lambda x, w: F.linear(F.linear(x, w.fc1)[:, : w.ffn], w.fc2),
}
TABLES: dict[str, dict[str, Callable[[], Variant]]] = {"gated": GATED, "mlp": MLP}
# Per table, each dispatch path (ops.dispatch.PATHS) and the variant that times it alone.
CANDIDATES = {
    "gated": {"gated": "gated_triton", "cublas": "cublas_act", "quack": "quack_act"},
    "mlp": {
        "fused_mlp": "fused_mlp",
        "gated": "gated_linear",
        "cublas": "cublas_act_linear",
        "quack": "quack_act_linear",
    },
}
# Kernel launches per call of each path: a near-tie goes to fewer (bench.inference_dispatch).
# fused_mlp zeroes its fp32 workspace, runs, then casts; quack's N-clustered configs are static
# persistent (no semaphore to zero).
LAUNCHES = {
    "gated": {"gated": 1, "cublas": 2, "quack": 1},
    "mlp": {"fused_mlp": 3, "gated": 2, "cublas": 3, "quack": 2},
}
EAGER = {"gated": ("eager_fused", "eager_separate"), "mlp": ("eager",)}
FLOORS = frozenset({"gemm_only"})
FUSED_MLP_MAX_BENCH_M = 512  # beyond this the fused kernel re-reads weights per 64-row block
