"""The gated GEMM as a torch.library op: fc1 and the SwiGLU epilogue in one kernel.

save_factors runs it on its packed fc1 (aux = the factors), drop_h on the canonical fc1
(aux = the preactivation it saves) and inference paths with no aux at all. Canonical weights
are the packed layout with chunk = F, so one op serves all three.
"""

from __future__ import annotations

import torch

from swiglu_train.ops.activation import triton_enabled
from swiglu_train.ops.eager import eager_op

try:
    from swiglu_train.kernels import gated_gemm as kernels
except ImportError:  # no Triton: callers take their plain-torch path
    kernels = None


def gated_enabled(x: torch.Tensor, chunk: int, ffn_size: int) -> bool:
    """Whether the fused kernel serves this input and layout (Triton runs and the chunk fits)."""
    if kernels is None or not triton_enabled(x):
        return False
    return chunk == ffn_size or kernels.fused_supported(x, chunk)


@eager_op("swiglu_train::gated_fwd", mutates_args=())
def gated_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int, aux: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, aux) from x and fc1 packed with ``chunk``; aux is empty when ``aux == "none"``."""
    h, aux_out = kernels.gated_gemm(x, weight, bias, chunk=chunk, aux=aux)
    return h, aux_out if aux_out is not None else x.new_empty(0)


@gated_fwd.register_fake
def _(x, weight, bias, chunk, aux):
    h = x.new_empty(x.shape[0], weight.shape[0] // 2)
    return h, x.new_empty(x.shape[0], weight.shape[0]) if aux != "none" else x.new_empty(0)
