"""drop_h_quack's grad_x on cuBLAS (``ops.concat_gemm``): the interleaved grad_preact times the
canonical fc1, in row chunks whose copy never outgrows the [M, F] h that backward freed."""

from __future__ import annotations

import pytest
import torch

from swiglu_train.ops.concat_gemm import (
    ROW_ALIGN,
    chunk_rows,
    concat_grad_w1,
    concat_grad_x,
    interleaved_rows,
)

SHAPES = pytest.mark.parametrize(
    ("m", "d", "ffn"),
    [(16, 64, 40), (16, 64, 37), (512, 16, 24), (1, 8, 3), (300, 96, 200)],
    ids=["five-chunks", "odd-F", "one-chunk", "tiny", "uneven"],
)


def _interleave_columns(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[g_0, u_0, g_1, u_1, ...] per row, as quack writes grad_preact."""
    return torch.stack((gate, up), dim=2).reshape(gate.shape[0], -1)


@SHAPES
def test_concat_grad_x_is_the_de_interleaved_product(m, d, ffn):
    torch.manual_seed(0)
    grad_gate, grad_up = (
        torch.randn(m, ffn, dtype=torch.float64),
        torch.randn(m, ffn, dtype=torch.float64),
    )
    fc1 = torch.randn(2 * ffn, d, dtype=torch.float64)  # canonical [W_gate; W_up]
    expected = grad_gate @ fc1[:ffn] + grad_up @ fc1[ffn:]
    actual = concat_grad_x(_interleave_columns(grad_gate, grad_up), fc1)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


@SHAPES
def test_concat_grad_w1_is_the_canonical_weight_grad(m, d, ffn):
    torch.manual_seed(2)
    grad_gate = torch.randn(m, ffn, dtype=torch.float64)
    grad_up = torch.randn(m, ffn, dtype=torch.float64)
    x = torch.randn(m, d, dtype=torch.float64)
    expected = torch.cat((grad_gate.t() @ x, grad_up.t() @ x))  # [grad_W_gate; grad_W_up]
    actual = concat_grad_w1(_interleave_columns(grad_gate, grad_up), x)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_a_swapped_pair_order_would_be_caught():
    """The negative control: reading the pairs as [u, g] gives a different product."""
    torch.manual_seed(1)
    grad_gate, grad_up, fc1 = torch.randn(8, 24), torch.randn(8, 24), torch.randn(48, 16)
    actual = concat_grad_x(_interleave_columns(grad_up, grad_gate), fc1)
    assert not torch.allclose(actual, grad_gate @ fc1[:24] + grad_up @ fc1[24:], atol=1e-3)


def test_interleaved_rows_pair_gate_and_up_rows():
    fc1 = torch.arange(12.0).reshape(6, 2)  # F = 3: gate rows 0-2, up rows 3-5
    rows = interleaved_rows(fc1, 1, 3)
    assert rows.tolist() == [[2.0, 3.0], [8.0, 9.0], [4.0, 5.0], [10.0, 11.0]]


@pytest.mark.parametrize(
    ("m", "d", "ffn"),
    [(4096, 4096, 11008), (1024, 4096, 11008), (16384, 8192, 28672), (16, 64, 40)],
)
def test_each_chunk_s_copy_fits_in_h_and_the_chunks_are_even(m, d, ffn):
    rows = chunk_rows(m, d, ffn)
    chunks = -(-ffn // rows)
    assert rows == ffn or rows % ROW_ALIGN == 0
    assert 2 * rows * d <= max(m * ffn, 2 * ROW_ALIGN * d)  # the copy [2·rows, D] within h [M, F]
    assert ffn - (chunks - 1) * rows > rows - chunks * ROW_ALIGN  # the last chunk is not a stub


def test_gemm_on_cublas_takes_each_gemm_s_operands_as_training_passes_them():
    """``quack_mlp.gemm_on``, the one entry point of training and pretune: on cuBLAS the concat
    GEMMs take (grad_preact, fc1) and (grad_preactᵀ, x) as the quack GEMM would, and a plain
    GEMM adds its bias."""
    from swiglu_train.ops.quack_mlp import gemm_on

    torch.manual_seed(3)
    m, d, ffn = 12, 16, 24
    grad_gate, grad_up = torch.randn(m, ffn, dtype=torch.float64), torch.randn(m, ffn).double()
    grad_preact = _interleave_columns(grad_gate, grad_up)
    fc1, x = torch.randn(2 * ffn, d, dtype=torch.float64), torch.randn(m, d, dtype=torch.float64)
    grad_x = gemm_on("cublas", "grad_x_concat", grad_preact, fc1)
    torch.testing.assert_close(grad_x, grad_gate @ fc1[:ffn] + grad_up @ fc1[ffn:])
    grad_w1 = gemm_on("cublas", "grad_w1_concat", grad_preact.t(), x)
    torch.testing.assert_close(grad_w1, torch.cat((grad_gate.t() @ x, grad_up.t() @ x)))
    h, fc2_t, bias = torch.randn(m, ffn).double(), torch.randn(ffn, d).double(), torch.randn(d)
    torch.testing.assert_close(gemm_on("cublas", "fc2", h, fc2_t, bias.double()), h @ fc2_t + bias)
