"""The experts' backward pass on an interleaved preactivation (feature f's gate and up at
columns 2f and 2f + 1, as quack's gated epilogue writes it for drop_h_quack): the same
grad_preact, w·h and router-weight gradient as on the canonical [gate | up] layout, on Triton
(the interpreter here) and on the torch path."""

from __future__ import annotations

import pytest
import torch

from swiglu_train.ops.activation import use_backend
from swiglu_train.ops.experts_steps import backward_rows


def interleave(t: torch.Tensor) -> torch.Tensor:
    """[R, 2F] canonical [gate | up] -> [g0, u0, g1, u1, ...]."""
    rows, two_f = t.shape
    return t.view(rows, 2, two_f // 2).transpose(1, 2).reshape(rows, two_f)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize(("rows", "ffn"), [(7, 24), (5, 40), (0, 16)])
def test_interleaved_preact_gives_the_canonical_results_interleaved(backend, weighted, rows, ffn):
    gen = torch.Generator().manual_seed(rows * 100 + ffn)
    preact = torch.randn(rows, 2 * ffn, generator=gen).to(torch.bfloat16)
    g = torch.randn(rows, ffn, generator=gen).to(torch.bfloat16)
    w = torch.rand(rows, generator=gen) if weighted else None
    with use_backend(backend):
        want = backward_rows([preact.clone()], g.clone(), w, inplace=True)
        got = backward_rows([interleave(preact)], g.clone(), w, inplace=True, interleaved=True)
    torch.testing.assert_close(got[0], interleave(want[0]), rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    if weighted:
        torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    else:
        assert got[2] is None and want[2] is None


def test_interleaved_backward_writes_over_the_saved_preact():
    """In place, as the canonical layout: no [R, 2F] buffer is allocated."""
    preact = interleave(torch.randn(6, 32).to(torch.bfloat16))
    g = torch.randn(6, 16).to(torch.bfloat16)
    with use_backend("triton"):
        grad_preact, wh, _ = backward_rows([preact], g, None, inplace=True, interleaved=True)
    assert grad_preact.data_ptr() == preact.data_ptr() and wh.data_ptr() == g.data_ptr()
