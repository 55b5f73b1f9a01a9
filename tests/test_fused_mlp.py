"""The fully fused MLP kernel (seed 004) through its launcher: CPU interpreter, or CUDA."""

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, device_backends
from helpers import TOLERANCE, rel_err

from swiglu_train.ops import reference

kernels = pytest.importorskip("swiglu_train.kernels.fused_mlp")
TRITON = [p for p in device_backends() if p.values[1] == "triton"]


def _weights(m, d, f, o, dtype, device, bias):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x = rand(m, d)
    w1, w2 = rand(2 * f, d, scale=d**-0.5), rand(o, f, scale=f**-0.5)
    b1, b2 = (rand(2 * f), rand(o)) if bias else (None, None)
    return x, w1, b1, w2, b2


def _float64(*tensors):
    return [None if t is None else t.double().cpu() for t in tensors]


def _round_like(t: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """t rounded to dtype as the kernel rounds: to nearest on CUDA, toward zero (bf16) in the
    interpreter, whose fp32 -> bf16 cast truncates."""
    t = t.float()
    if dtype == torch.bfloat16 and device == "cpu":
        return (t.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return t.to(dtype).float()


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(
    ("m", "d", "f", "o"),
    [(1, 40, 48, 40), (5, 24, 23, 19), (17, 33, 40, 24), (70, 19, 37, 45)],
    ids=["M1", "oddF", "M17", "two-row-blocks"],
)
def test_matches_float64_reference(device, backend, dtype, bias, m, d, f, o):
    x, w1, b1, w2, b2 = _weights(m, d, f, o, dtype, device, bias)
    expected = reference.mlp(*_float64(x, w1, b1, w2, b2))
    # The interpreter's truncating bf16 cast biases the five roundings (gate, up, silu, h, y).
    tol = TOLERANCE[dtype] * (2 if device == "cpu" and dtype == torch.bfloat16 else 1)
    for deterministic in (False, True):
        y = kernels.fused_mlp(x, w1, b1, w2, b2, deterministic=deterministic)
        assert y.shape == (m, o) and y.dtype == dtype
        assert rel_err(y, expected) < tol, deterministic


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_h_is_rounded_as_eager_rounds_it(device, backend):
    """gate, up, silu and h each rounded to bf16 as eager rounds them, then y once: the kernel
    agrees with that emulation on (almost) every element, where an unrounded h would not."""
    dtype, (m, d, f, o) = torch.bfloat16, (9, 40, 48, 40)
    x, w1, b1, w2, b2 = _weights(m, d, f, o, dtype, device, bias=True)
    x64, w1_64, b1_64, w2_64, b2_64 = _float64(x, w1, b1, w2, b2)
    gate, up = _round_like(F.linear(x64, w1_64, b1_64), dtype, device).double().chunk(2, -1)
    silu = _round_like(F.silu(gate), dtype, device).double()
    h = _round_like(silu * up, dtype, device).double()
    expected = _round_like(F.linear(h, w2_64, b2_64), dtype, device)
    y = kernels.fused_mlp(x, w1, b1, w2, b2).float().cpu()
    assert (y != expected).float().mean() <= 0.01  # fp32 sum order may flip a rare rounding
    torch.testing.assert_close(y, expected, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_empty_batch_and_row_strides(device, backend):
    x, w1, _, w2, _ = _weights(6, 32, 16, 24, torch.float32, device, bias=False)
    assert kernels.fused_mlp(x[:0], w1, None, w2, None).shape == (0, 24)
    wide = torch.randn(6, 40, device=device)[:, :32]  # row stride 40, stride 1 along D
    wide.copy_(x)
    expected = reference.mlp(*_float64(x, w1, None, w2, None))
    assert rel_err(kernels.fused_mlp(wide, w1, None, w2, None), expected) < 1e-5


def test_bad_inputs_get_clear_errors(monkeypatch):
    x, w1, b1, w2, b2 = _weights(4, 16, 24, 8, torch.float32, "cpu", bias=True)
    cases = [
        (TypeError, "one dtype", (x, w1.double(), b1, w2, b2)),
        (TypeError, "one dtype", (x.double(), w1.double(), None, w2.double(), None)),
        (TypeError, "fc2_bias is torch.bfloat16", (x, w1, b1, w2, b2.bfloat16())),
        (ValueError, "do not chain", (x, w1[:, :8], b1, w2, b2)),
        (ValueError, "do not chain", (x, w1, b1, w2[:, :12], b2)),
        (ValueError, "do not chain", (x, w1[:47], None, w2, b2)),
        (ValueError, "2D x", (x[None], w1, b1, w2, b2)),
        (ValueError, "fc2_weight is on meta", (x, w1, b1, w2.to("meta"), b2)),
        (ValueError, r"fc1_bias must be a contiguous \[48\]", (x, w1, b1[:24], w2, b2)),
        (ValueError, r"fc2_bias must be a contiguous \[8\]", (x, w1, b1, w2, b2[:4])),
        (ValueError, "fc2_weight must be row-major", (x, w1, b1, w2.t().contiguous().t(), b2)),
        (ValueError, "x must be row-major", (x.t().contiguous().t(), w1, b1, w2, b2)),
    ]
    for error, match, args in cases:
        with pytest.raises(error, match=match):
            kernels.fused_mlp(*args)
    monkeypatch.setattr(kernels, "triton_runs_on", lambda device: False)
    with pytest.raises(RuntimeError, match="needs CUDA, or TRITON_INTERPRET=1"):
        kernels.fused_mlp(x, w1, b1, w2, b2)


def test_bias_stride_is_checked():
    x, w1, _, w2, _ = _weights(4, 16, 24, 8, torch.float32, "cpu", bias=False)
    strided = torch.randn(8, 2)[:, 0]  # [8] with stride 2
    with pytest.raises(ValueError, match="contiguous"):
        kernels.fused_mlp(x, w1, None, w2, strided)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64])
def test_cuda_matches_eager_at_qwen_05b(m):
    """At a real shape, no further from float64 than eager bf16 is, and deterministic when
    asked: five runs bitwise equal."""
    x, w1, b1, w2, b2 = _weights(m, 896, 4864, 896, torch.bfloat16, "cuda", bias=False)
    expected = reference.mlp(*_float64(x, w1, b1, w2, b2))
    eager = reference.mlp(x, w1, b1, w2, b2)
    y = kernels.fused_mlp(x, w1, b1, w2, b2)
    assert rel_err(y, expected) <= 1.25 * rel_err(eager, expected)
    assert rel_err(y, eager) < 2**-7
    runs = [kernels.fused_mlp(x, w1, b1, w2, b2, deterministic=True) for _ in range(5)]
    assert all(torch.equal(r, runs[0]) for r in runs)
    assert rel_err(runs[0], expected) <= 1.25 * rel_err(eager, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_graph_replay_recomputes_from_new_inputs():
    """The workspace is zeroed inside the graph: every replay starts its atomics from zero."""
    x, w1, b1, w2, b2 = _weights(4, 896, 4864, 896, torch.bfloat16, "cuda", bias=True)
    kernels.fused_mlp(x, w1, b1, w2, b2)  # autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.fused_mlp(x, w1, b1, w2, b2)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, reference.mlp(x, w1, b1, w2, b2)) < 2**-7
