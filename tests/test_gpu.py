"""CUDA-only checks: allocator-exact memory, in-place backward, odd widths, large indices."""

import pytest
import torch

from swiglu_train import ParMLP
from swiglu_train.ops import reference
from swiglu_train.ops.activation import swiglu_bwd_recompute_, swiglu_fwd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
M, D, F = 4099, 1024, 2816


# Activations of whole 2 MiB multiples: the caching allocator may serve a request from a cached
# block up to 1 MiB larger without splitting it, which would blur an exact byte count.
ALIGNED_M = 4096


def after_forward_bytes(impl: str) -> int:
    mlp = ParMLP(D, F, impl=impl, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ALIGNED_M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(x).sum().backward()  # warm-up: compiles and cuBLAS workspaces
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = mlp(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del y
    return held


def test_drop_h_holds_exactly_one_h_less_after_forward():
    normal, drop_h = after_forward_bytes("normal"), after_forward_bytes("drop_h")
    assert normal - drop_h == ALIGNED_M * F * 2


def test_inplace_backward_kernel_allocates_nothing():
    preact = torch.randn(M, 2 * F, device="cuda", dtype=torch.bfloat16)
    grad_h = torch.randn(M, F, device="cuda", dtype=torch.bfloat16)
    swiglu_bwd_recompute_(preact.clone(), grad_h.clone())  # compiles first
    expected_h = reference.swiglu(preact)
    expected_grad = reference.swiglu_grad(preact, grad_h)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    swiglu_bwd_recompute_(preact, grad_h)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == base
    torch.testing.assert_close(grad_h, expected_h, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(preact, expected_grad, rtol=2**-7, atol=2**-7)


def test_inplace_call_at_an_odd_width():
    """An F that no tile divides: the masked last column tile, read before overwritten."""
    f = 1000 + 2 * torch.randint(0, 499, ()).item() + 1  # odd: no tile divides it
    preact = torch.randn(3001, 2 * f, device="cuda", dtype=torch.bfloat16)
    grad_h = torch.randn(3001, f, device="cuda", dtype=torch.bfloat16)
    expected_h = swiglu_fwd(preact)
    expected_grad = reference.swiglu_grad(preact, grad_h)
    swiglu_bwd_recompute_(preact, grad_h)
    assert torch.equal(grad_h, expected_h)
    torch.testing.assert_close(preact, expected_grad, rtol=2**-7, atol=2**-7)


def test_indices_beyond_int32():
    m, f = 65539, 16384  # preact has m * 2f > 2**31 elements
    preact = torch.empty(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    preact[-3:].normal_()
    preact[:-3].zero_()
    h = swiglu_fwd(preact)
    torch.testing.assert_close(h[-3:], reference.swiglu(preact[-3:]), rtol=2**-7, atol=1e-6)
    assert h[:-3].abs().max() == 0


def test_forward_matches_eager_bitwise_on_cuda():
    preact = torch.randn(2048, 2 * 3072, device="cuda", dtype=torch.bfloat16) * 4
    mismatched = (swiglu_fwd(preact) != reference.swiglu(preact)).float().mean().item()
    assert mismatched < 1e-3  # rounding silu first reproduces eager; exp may differ by an ulp


@pytest.mark.parametrize("chunk", [128, 64, 32])
def test_gated_gemm_at_training_tiles_matches_cublas_math(chunk):
    """bf16 at a size where the tuned [128, 2·128] tiles run: the wide single-dot path when the
    tile is the chunk, two dots otherwise, TMA loads and stores; h equals eager's h of the
    kernel's own preact bit for bit, and the factors match the torch math of cuBLAS's preact."""
    from swiglu_train.kernels.gated_gemm import gated_gemm
    from swiglu_train.layers.layout import CANONICAL, Layout, order
    from swiglu_train.ops.save_factors import swiglu_packed

    m, k, f = 1000, 512, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2 * f, k, device="cuda") / k**0.5).to(torch.bfloat16)
    packed = w[order(2 * f, CANONICAL, Layout("packed", chunk)).cuda()]
    h, preact = gated_gemm(x, packed, None, chunk=chunk, aux="preact")
    pairs = preact.view(m, -1, 2, chunk)
    assert torch.equal(h, (torch.nn.functional.silu(pairs[:, :, 0]) * pairs[:, :, 1]).view(m, f))
    _, factors = gated_gemm(x, packed, None, chunk=chunk, aux="factors")
    _, expected = swiglu_packed(torch.nn.functional.linear(x, packed), chunk)
    torch.testing.assert_close(factors, expected, rtol=2**-6, atol=1e-2)
    canonical_h, _ = gated_gemm(x, w, None, chunk=f)
    torch.testing.assert_close(h, canonical_h, rtol=2**-6, atol=1e-2)
