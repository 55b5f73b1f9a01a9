"""CUDA-only checks of drop_h with the FP8-saved preactivation: the kernels at training sizes
against the torch path and float64, and the bytes the allocator holds after forward.

Run on the H200 with ``python -m pytest tests/test_gpu_fp8_saved.py tests/test_fp8_saved.py
-m gpu``; tests/test_fp8_saved.py's ``cuda`` cases run the same format checks on the GPU.
"""

import pytest
import torch
from helpers import rel_err

from swiglu_train import ParMLP
from swiglu_train.kernels.fp8_format import n_blocks
from swiglu_train.ops import reference
from swiglu_train.ops.fp8_saved import (
    dequantize,
    quantize,
    recompute,
    swiglu_bwd_fp8_,
    swiglu_fwd_fp8,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
M, D = 4099, 1024  # M odd: a partial row tile
NAMES = ("w1", "b1", "w2", "b2")


@pytest.mark.parametrize("ffn", [2816, 1000])  # 1000: a partial 128-column block per half
def test_kernels_at_training_sizes(ffn):
    preact = (torch.randn(M, 2 * ffn, device="cuda") * 2).bfloat16()
    preact[:, 7] *= 100  # an outlier column in gate block 0
    h, q, scales = swiglu_fwd_fp8(preact)
    expected_q, expected_scales = quantize(preact)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(scales, expected_scales)
    torch.testing.assert_close(h, reference.swiglu(preact), rtol=2**-7, atol=2**-7)
    assert rel_err(dequantize(q, scales), preact.float()) < 2**-4

    grad_h = torch.randn(M, ffn, device="cuda").bfloat16()
    expected_h, expected_grad = recompute(q, scales, grad_h)
    exact = reference.swiglu_grad(preact.double(), grad_h.double())
    grad_preact = grad_h.new_empty(M, 2 * ffn)
    swiglu_bwd_fp8_(q, scales, grad_h, grad_preact)
    torch.testing.assert_close(grad_h, expected_h, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(grad_preact, expected_grad, rtol=2**-7, atol=2**-7)
    assert 1e-2 < rel_err(grad_preact, exact) < 0.06


def test_mlp_grads_against_float64():
    ffn, out = 2816, 1024
    mlp = ParMLP(D, ffn, out, bias=True, saved_fp8=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(M, out, device="cuda", dtype=torch.bfloat16)
    mlp(x).backward(grad_y)
    params = [p.detach().double().requires_grad_() for p in mlp.parameters()]
    x64 = x.detach().double().requires_grad_()
    reference.mlp(x64, *params).backward(grad_y.double())
    got = {"x": x.grad, **dict(zip(NAMES, (p.grad for p in mlp.parameters()), strict=True))}
    expected = {"x": x64.grad, **dict(zip(NAMES, (p.grad for p in params), strict=True))}
    for name in got:
        err = rel_err(got[name], expected[name])
        limit = 1e-2 if name == "b2" else 0.06  # b2's grad is grad_y's sum: no FP8 in it
        assert err < limit, (name, err)
        if name != "b2":
            assert err > 1e-2, (name, err)


ALIGNED_M = 4096  # activations of whole 2 MiB multiples (see tests/test_gpu.py)


def after_forward_bytes(saved_fp8: bool, ffn: int) -> int:
    mlp = ParMLP(D, ffn, saved_fp8=saved_fp8, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ALIGNED_M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(x).sum().backward()  # warm-up: compiles and cuBLAS workspaces
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = mlp(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del y
    return held


def test_after_forward_holds_the_fp8_copy_and_scales_instead_of_the_preactivation():
    ffn = 2816
    drop_h, fp8 = after_forward_bytes(False, ffn), after_forward_bytes(True, ffn)
    scales = ALIGNED_M * 2 * n_blocks(ffn) * 4
    assert drop_h - fp8 == ALIGNED_M * 2 * ffn * 2 - (ALIGNED_M * 2 * ffn + scales)
