"""The gated GEMM kernel: every layout (canonical = chunk F, packed) and every aux output."""

import pytest
import torch
import torch.nn.functional as F
from conftest import device_backends

from swiglu_train.layers.layout import CANONICAL, Layout, order
from swiglu_train.ops.save_factors import swiglu_packed

kernels = pytest.importorskip("swiglu_train.kernels.gated_gemm")
gated_autotune = pytest.importorskip("swiglu_train.kernels.gated_autotune")
TRITON = [p for p in device_backends() if p.values[1] == "triton"]


def _torch_gated(x, w, bias, chunk):
    """(h, factors, preact) of the plain-torch math, in W1's own column order."""
    preact = F.linear(x, w, bias)
    h, factors = swiglu_packed(preact, chunk)
    return h, factors, preact


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    ("m", "k", "f", "chunk"),
    [(37, 40, 48, 48), (5, 24, 23, 23), (21, 19, 64, 16), (1, 33, 40, 40), (40, 16, 64, 32)],
    ids=["canonical", "odd-F", "packed16", "M1", "packed32"],
)
def test_every_aux_matches_the_torch_math(device, backend, bias, m, k, f, chunk):
    x = torch.randn(m, k, device=device)
    w = torch.randn(2 * f, k, device=device) / k**0.5
    b = torch.randn(2 * f, device=device) if bias else None
    ref_h, ref_factors, ref_preact = _torch_gated(x, w, b, chunk)
    for aux, expected in (("none", None), ("factors", ref_factors), ("preact", ref_preact)):
        h, out = kernels.gated_gemm(x, w, b, chunk=chunk, aux=aux)
        torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
        if expected is None:
            assert out is None
        else:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_packed_weights_give_the_canonical_h(device, backend):
    """Packing permutes fc1's rows only: h is the same function of x in either layout."""
    f, k = 64, 32
    x = torch.randn(9, k, device=device)
    w = torch.randn(2 * f, k, device=device)
    packed = w[order(2 * f, CANONICAL, Layout("packed", 16)).to(device)]
    h_canonical, _ = kernels.gated_gemm(x, w, None, chunk=f)
    h_packed, _ = kernels.gated_gemm(x, packed, None, chunk=16)
    torch.testing.assert_close(h_packed, h_canonical, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_bf16_h_is_rounded_like_eager(device, backend):
    """gate and up are rounded to bf16 first, as a GEMM output is, so h is eager's h of them."""
    x = torch.randn(17, 32, device=device, dtype=torch.bfloat16)
    w = (torch.randn(96, 32, device=device) / 6).to(torch.bfloat16)
    h, preact = kernels.gated_gemm(x, w, None, chunk=48, aux="preact")
    expected = F.silu(preact[:, :48]) * preact[:, 48:]
    if device == "cuda":
        assert torch.equal(h, expected)
    else:  # the interpreter rounds fp32 -> bf16 toward zero: silu and h, an ulp each
        torch.testing.assert_close(h, expected, rtol=2**-6, atol=1e-6)
    gemm = F.linear(x.float(), w.float()).to(torch.bfloat16)  # a correctly rounded GEMM
    torch.testing.assert_close(preact, gemm, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_empty_and_noncontiguous_inputs(device, backend):
    w = torch.randn(64, 24, device=device)
    h, aux = kernels.gated_gemm(torch.empty(0, 24, device=device), w, None, chunk=32, aux="preact")
    assert h.shape == (0, 32) and aux.shape == (0, 64)
    x = torch.randn(24, 11, device=device).t()  # [11, 24], column-major
    h, _ = kernels.gated_gemm(x, w, None, chunk=32)
    torch.testing.assert_close(h, _torch_gated(x, w, None, 32)[0], rtol=1e-5, atol=1e-5)


def _config(bm: int, bn: int, bk: int, stages: int = 4):
    import triton

    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PERSISTENT": False},
        num_stages=stages,
        num_warps=8,
    )


def _tiles(configs) -> set[tuple[int, int, int]]:
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in configs}


def test_prune_fits_configs_to_the_chunk_the_dtype_and_m():
    """Found on the H200: fp32 tiles sized for bf16 overflow shared memory, and a chunk
    narrower than every tile left no config at all."""
    configs = [_config(128, 128, 64), _config(64, 64, 128), _config(16, 64, 128)]
    bf16 = {"b_ptr": torch.empty(1, dtype=torch.bfloat16)}
    big = gated_autotune.prune_configs(configs, {"F": 4096, "M_BUCKET": 16384, **bf16}, CHUNK=128)
    assert _tiles(big) == _tiles(configs)  # training shapes in bf16: nothing changes
    narrow = gated_autotune.prune_configs(configs, {"F": 64, "M_BUCKET": 16384, **bf16}, CHUNK=16)
    assert {n for _, n, _ in _tiles(narrow)} == {16}
    canonical = gated_autotune.prune_configs(
        configs, {"F": 48, "M_BUCKET": 16384, **bf16}, CHUNK=48
    )
    assert _tiles(canonical) == _tiles(configs)  # canonical tiles may cross F (clipped)
    fp32 = {"b_ptr": torch.empty(1)}
    for c in gated_autotune.prune_configs(
        configs, {"F": 4096, "M_BUCKET": 16384, **fp32}, CHUNK=128
    ):
        per_stage = (c.kwargs["BLOCK_M"] + 2 * c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 4
        assert per_stage * c.num_stages <= gated_autotune.SHARED_MEMORY_BYTES
    decode = gated_autotune.prune_configs(configs, {"F": 4096, "M_BUCKET": 1, **bf16}, CHUNK=128)
    assert _tiles(decode) == {(16, 64, 128)}


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_drop_h_fused_forward_is_the_same_drop_h(device, backend, bias):
    """The gated GEMM's preact variant feeds drop_h's unchanged backward: same y and grads."""
    from swiglu_train.ops import drop_h_mlp

    m, d, f = 13, 24, 40
    x = torch.randn(m, d, device=device, requires_grad=True)
    params = [torch.randn(2 * f, d, device=device) / d**0.5, torch.randn(2 * f, device=device)]
    params += [torch.randn(d, f, device=device) / f**0.5, torch.randn(d, device=device)]
    if not bias:
        params[1] = params[3] = None
    params = [p.requires_grad_() if p is not None else None for p in params]
    grad_y = torch.randn(m, d, device=device)
    results = []
    for fused in (False, True):
        y = drop_h_mlp(x, *params, fused_forward=fused)
        leaves = [t for t in (x, *params) if t is not None]
        results.append((y, *torch.autograd.grad(y, leaves, grad_y)))
    for plain, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
