"""SonicMoE (Dao-AILab, arXiv 2512.14080) as a peer: its token-choice top-k layer
(``moe_TC_softmax_topk_layer``) with the router left out, on its default kernels.

SonicMoE is not on the package registry, and its snapshot needs the quack of one commit
(3d0ab3ec, between 0.2.2 and 0.2.3) with nvidia-cutlass-dsl 4.2.1: quack 0.6.5 lacks modules
it imports (``quack.gemm_act``, ``quack.gemm_wrapper_utils``). It therefore runs in a process
of its own (its wheels first on PYTHONPATH), where our quack impls are recorded as failed;
the two runs' JSONs merge (``bench-moe --merge``), each row with the floor of its own run.

The layer is entered below its router: the expert counts are taken with torch (SonicMoE's
``count_cumsum`` is a CUDA extension compiled with nvcc on first use), then its routing
metadata, up-projection and down-projection functions run as its layer runs them.
"""

from __future__ import annotations

import torch

from swiglu_train.bench.moe.weights import ExpertWeights, Variant


def interleave(fc1: torch.Tensor) -> torch.Tensor:
    """Canonical [E, 2F, D] = [gate; up] to SonicMoE's rows: gate_i at 2i, up_i at 2i + 1."""
    e, two_f, d = fc1.shape
    return fc1.view(e, 2, two_f // 2, d).transpose(1, 2).reshape(e, two_f, d)


def deinterleave(fc1: torch.Tensor) -> torch.Tensor:
    e, two_f, d = fc1.shape
    return fc1.view(e, two_f // 2, 2, d).transpose(1, 2).reshape(e, two_f, d)


def sonicmoe(w: ExpertWeights, top_k: int) -> Variant:
    """SonicMoE's layer on a copy of fc1 in its interleaved layout; fc2 is shared."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import TC_topk_router_metadata, _DownProjection, _UpProjection

    e = w.fc1.shape[0]
    c_fc = torch.nn.Parameter(interleave(w.fc1.detach()))
    stream = torch.cuda.current_stream().cuda_stream
    swiglu = ActivationType.SWIGLU

    def run(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        indices = indices.to(torch.int32)
        ends = torch.cumsum(torch.bincount(indices.view(-1), minlength=e), 0, dtype=torch.int32)
        meta = TC_topk_router_metadata(indices, ends, top_k)
        offsets, routing = meta[0], meta[1:]
        w1, w2 = c_fc.permute(1, 2, 0), w.fc2.permute(1, 2, 0)  # as its MoE module passes them
        y1, z = _UpProjection.apply(
            x, w1, None, offsets, t * top_k, top_k, stream, *routing, False, swiglu, False
        )
        return _DownProjection.apply(
            y1, z, w2, None, weights, offsets, t, top_k, stream, *routing, False, swiglu
        )

    def weight_grads() -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None if c_fc.grad is None else deinterleave(c_fc.grad)), w.fc2.grad

    return Variant(run, weight_grads, [c_fc])
