"""save_factors' two GEMM epilogues, written on quack's ``@gemm_epilogue`` (CuTe DSL, sm_90).

quack supplies the GEMM mainloop (TMA, warp-specialized, persistent: cuBLAS speed on the
H200); these functions are what runs on each accumulator pair before it is stored. quack
pairs adjacent output columns, so fc1 must be in the packed layout with chunk 1
([g_0, u_0, g_1, u_1, ...]), and the factors come out in that same column order.

This module imports quack at load time; ``ops.quack_save_factors`` imports it only once quack
is known to be installed. The epilogues are module globals because quack keys its compiled
kernels by the function's source and re-imports them by name in its compile workers.
"""

from __future__ import annotations

from quack.activation import sigmoid
from quack.epilogue import gemm_epilogue, pack, unpack
from quack.epilogue.ops import RowVecLoad


def _factors_and_h(gate, up):
    """(dh/dgate, dh/dup, h) for h = silu(gate) * up, in fp32 registers."""
    sig = sigmoid(gate)
    silu = gate * sig
    # silu'(gate) = sig * (1 + gate * (1 - sig)) = sig - silu * sig + silu: two FFMAs
    return (sig - silu * sig + silu) * up, silu, silu * up


@gemm_epilogue(outputs=("h",), mode="acc_pair")
def swiglu_factors_epilogue(acc):
    """fc1 forward: D <- the factors (both lanes of each pair), h <- SwiGLU; no preact stored."""
    gate, up = unpack(acc)
    d_gate, d_up, h = _factors_and_h(gate, up)
    return {"D": pack(d_gate, d_up), "h": h}


@gemm_epilogue(outputs=("h",), ops={"bias": RowVecLoad("bias")}, mode="acc_pair")
def swiglu_factors_bias_epilogue(acc, bias):
    """As swiglu_factors_epilogue, with fc1's (packed, chunk 1) bias added to the accumulator."""
    gate, up = unpack(acc + bias)
    d_gate, d_up, h = _factors_and_h(gate, up)
    return {"D": pack(d_gate, d_up), "h": h}


@gemm_epilogue(mode="packed_cd_b16x2")
def factors_to_grad_epilogue(acc, c):
    """grad_h GEMM: acc = grad_h, c = the saved factors; D <- grad_preact = grad_h ⊙ factors.

    grad_h never reaches memory. D may alias c: each tile reads its factors before it stores.
    """
    d_gate, d_up = unpack(c)
    return {"D": pack(acc * d_gate, acc * d_up)}
