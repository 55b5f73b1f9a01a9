"""drop_h_quack's grad_x and grad_W1 on cuBLAS. quack writes grad_preact with gate and up
interleaved per column ([g_0, u_0, g_1, u_1, ...]) while fc1 and its grad are our canonical
[W_gate; W_up] rows.

quack's GEMM reads and writes that pairing directly (``concat_layout``), but at three of four
H200 training shapes its concat grad_x ran 1.10-1.63x cuBLAS's plain one and its grad_W1
1.03-1.45x (benchmarks/results/gemm/probe_quack_gemms_h200.json). cuBLAS needs the pair order on
both sides: grad_x reads fc1's rows interleaved, a copy; grad_W1 comes out interleaved and is
scattered into the canonical rows. Both go in row chunks, each temporary at most the bytes of
the [M, F] h that backward has just freed, so that the peak does not rise. Whether the copies
pay is a per-shape question for ``swiglu-train pretune`` (``ops.gemm_choice``: GEMMs
``grad_x_concat`` and ``grad_w1_concat``).
"""

from __future__ import annotations

import torch

ROW_ALIGN = 8  # F rows per chunk: 16 interleaved columns, a multiple of cuBLAS's K step


def chunk_rows(m: int, d: int, ffn: int) -> int:
    """F rows of fc1 per chunk: the interleaved copy [2·rows, D] holds at most h's [M, F]
    elements, split evenly over the chunks that takes, rounded up to ROW_ALIGN."""
    bound = max((m * ffn) // (2 * d) // ROW_ALIGN * ROW_ALIGN, ROW_ALIGN)
    chunks = -(-ffn // bound)
    return min(-(-ffn // (chunks * ROW_ALIGN)) * ROW_ALIGN, ffn)


def interleaved_rows(fc1_weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [g_start, u_start, ..., g_stop-1, u_stop-1] of a canonical [W_gate; W_up] fc1."""
    ffn = fc1_weight.shape[0] // 2
    gate, up = fc1_weight[start:stop], fc1_weight[ffn + start : ffn + stop]
    return torch.stack((gate, up), dim=1).reshape(2 * (stop - start), fc1_weight.shape[1])


def concat_grad_x(grad_preact: torch.Tensor, fc1_weight: torch.Tensor) -> torch.Tensor:
    """grad_preact [M, 2F] (interleaved) @ fc1 [2F, D] (canonical) on cuBLAS, fc1's rows
    interleaved chunk by chunk; the same product as quack's ``concat_layout=("B",)``."""
    m, ffn, d = grad_preact.shape[0], fc1_weight.shape[0] // 2, fc1_weight.shape[1]
    rows = chunk_rows(m, d, ffn)
    grad_x = None
    for start in range(0, ffn, rows):
        stop = min(start + rows, ffn)
        part = grad_preact[:, 2 * start : 2 * stop]  # a column slice: cuBLAS takes its stride
        weight = interleaved_rows(fc1_weight, start, stop)
        grad_x = part @ weight if grad_x is None else grad_x.addmm_(part, weight)
        del weight  # the next chunk's copy reuses this one's memory
    return grad_x


def concat_grad_w1(grad_preact: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_preact (interleaved)ᵀ @ x [M, D], as canonical [grad_W_gate; grad_W_up] rows, on
    cuBLAS: each chunk's interleaved [2·rows, D] product scattered into its gate and up rows."""
    m, ffn, d = x.shape[0], grad_preact.shape[1] // 2, x.shape[1]
    grad_w1 = torch.empty(2 * ffn, d, dtype=x.dtype, device=x.device)
    rows = chunk_rows(m, d, ffn)
    for start in range(0, ffn, rows):
        stop = min(start + rows, ffn)
        pairs = (grad_preact[:, 2 * start : 2 * stop].t() @ x).view(stop - start, 2, d)
        grad_w1[start:stop] = pairs[:, 0]
        grad_w1[ffn + start : ffn + stop] = pairs[:, 1]
        del pairs
    return grad_w1
