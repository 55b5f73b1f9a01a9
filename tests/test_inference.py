"""The no-grad path: dispatch among fused MLP, gated GEMM + cuBLAS and torch, and ParMLP's use."""

import pytest
import torch
from conftest import device_backends
from helpers import TOLERANCE, rel_err

from swiglu_train import ParMLP
from swiglu_train.layers import MLP_IMPLS
from swiglu_train.layers import par_mlp as par_mlp_module
from swiglu_train.layers.layout import CANONICAL, Layout, relayout
from swiglu_train.ops import inference, reference, use_backend

TRITON = [p for p in device_backends() if p.values[1] == "triton"]
D, FFN = 32, 48


def _canonical(device, bias=False):
    w1 = torch.randn(2 * FFN, D, device=device) / D**0.5
    w2 = torch.randn(D, FFN, device=device) / FFN**0.5
    if not bias:
        return w1, None, w2, None
    return w1, torch.randn(2 * FFN, device=device), w2, torch.randn(D, device=device)


@pytest.fixture
def taken(monkeypatch) -> list[str]:
    """The kernels the inference path called, in order (the real ones still run)."""
    calls: list[str] = []
    for name in ("fused_mlp", "gated_fwd", "swiglu_fwd"):
        real = getattr(inference, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(inference, name, spy)
    return calls


@pytest.mark.parametrize(("device", "backend"), TRITON)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_each_path_is_taken_where_it_should_be_and_agrees(device, backend, bias, taken):
    w1, b1, w2, b2 = _canonical(device, bias)
    packed = Layout("packed", 16)
    w1_packed, b1_packed = (None if t is None else relayout(t, CANONICAL, packed) for t in (w1, b1))
    small_m = inference.DEFAULT_FUSED_MLP_MAX_M
    cases = [  # (M, fc1 weight, fc1 bias, chunk, path, kernel called)
        (1, w1, b1, None, "fused_mlp", "fused_mlp"),
        (small_m, w1, b1, None, "fused_mlp", "fused_mlp"),
        (small_m + 1, w1, b1, None, "gated", "gated_fwd"),
        (3, w1_packed, b1_packed, 16, "gated", "gated_fwd"),
    ]
    if device == "cpu":  # the interpreter is too slow for model-sized calls: torch serves them
        big = inference.INTERPRETER_MAX_M + 1
        cases.append((big, w1, b1, None, "torch", None))
        cases.append((big, w1_packed, b1_packed, 16, "torch", None))
    for m, fc1, fc1_bias, chunk, path, kernel in cases:
        x = torch.randn(m, D, device=device)
        assert inference.inference_path(x, fc1, w2, chunk) == path
        taken.clear()
        y = inference.swiglu_mlp_inference(x, fc1, fc1_bias, w2, b2, chunk)
        assert taken == ([kernel] if kernel else [])
        expected = reference.mlp(x.double(), w1.double(), _double(b1), w2.double(), _double(b2))
        assert rel_err(y, expected) < TOLERANCE[torch.float32], (m, chunk)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_canonical_fc1_beyond_gated_max_m_takes_cublas_and_the_activation_kernel(
    device, backend, taken, monkeypatch
):
    """Training-sized no-grad calls (checkpointing's first forward) keep the cuBLAS fc1 that
    beats our gated GEMM there; a packed fc1 has no such path and stays gated."""
    monkeypatch.setattr(inference, "GATED_MAX_M", 20)
    w1, b1, w2, b2 = _canonical(device, bias=True)
    packed = Layout("packed", 16)
    w1_packed, b1_packed = (relayout(t, CANONICAL, packed) for t in (w1, b1))
    x = torch.randn(21, D, device=device)
    expected = reference.mlp(x.double(), w1.double(), b1.double(), w2.double(), b2.double())
    for fc1, fc1_bias, chunk, path, kernel in (
        (w1, b1, None, "cublas", "swiglu_fwd"),
        (w1_packed, b1_packed, 16, "gated", "gated_fwd"),
    ):
        assert inference.inference_path(x, fc1, w2, chunk) == path
        taken.clear()
        y = inference.swiglu_mlp_inference(x, fc1, fc1_bias, w2, b2, chunk)
        assert taken == [kernel]
        assert rel_err(y, expected) < TOLERANCE[torch.float32]


def _double(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("chunk", [None, 16, 24], ids=["canonical", "packed16", "packed24"])
def test_torch_path_where_triton_is_off(chunk, taken):
    """use_backend("torch") (or no Triton on the device): plain torch, in either layout, and a
    chunk no kernel takes (24 is not a power of two) falls back to torch as well."""
    w1, b1, w2, b2 = _canonical("cpu", bias=True)
    layout = CANONICAL if chunk is None else Layout("packed", chunk)
    fc1, fc1_bias = relayout(w1, CANONICAL, layout), relayout(b1, CANONICAL, layout)
    x = torch.randn(5, D)
    expected = reference.mlp(x.double(), w1.double(), b1.double(), w2.double(), b2.double())
    backends = ["torch"] if chunk != 24 else ["torch", "auto"]
    for backend in backends:
        with use_backend(backend):
            assert inference.inference_path(x, fc1, w2, chunk) == "torch"
            y = inference.swiglu_mlp_inference(x, fc1, fc1_bias, w2, b2, chunk)
        assert taken == []
        assert rel_err(y, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_measured_table_sets_the_crossover(device, backend, monkeypatch):
    w1, _, w2, _ = _canonical(device)
    monkeypatch.setitem(inference.FUSED_MLP_MAX_M, (D, FFN), 4)
    assert inference.fused_mlp_max_m(D, FFN) == 4
    assert inference.fused_mlp_max_m(D, FFN + 16) == inference.DEFAULT_FUSED_MLP_MAX_M
    paths = [
        inference.inference_path(torch.empty(m, D, device=device), w1, w2, None) for m in (4, 5)
    ]
    assert paths == ["fused_mlp", "gated"]
    x = torch.randn(7, D, device=device).t().contiguous().t()  # column-major: made row-major
    expected = reference.mlp(x.double(), w1.double(), None, w2.double(), None)
    assert rel_err(inference.swiglu_mlp_inference(x, w1, None, w2, None, None), expected) < 1e-5


def test_grad_needed():
    x, w = torch.randn(2, 3), torch.randn(3, 3, requires_grad=True)
    assert inference.grad_needed(x, w, None)
    assert not inference.grad_needed(x, w.detach(), None)
    with torch.no_grad():
        assert not inference.grad_needed(x, w)
    with torch.inference_mode():
        assert not inference.grad_needed(x, w)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", MLP_IMPLS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_par_mlp_takes_the_inference_path_without_grad(device, backend, impl, bias, monkeypatch):
    calls = []
    real = par_mlp_module.swiglu_mlp_inference

    def spy(*args, **kwargs):
        calls.append(kwargs["chunk"])
        return real(*args, **kwargs)

    monkeypatch.setattr(par_mlp_module, "swiglu_mlp_inference", spy)
    mlp = ParMLP(D, FFN, bias=bias, impl=impl, chunk=16, device=device)
    x = torch.randn(2, 5, D, device=device)
    with use_backend(backend):
        trained = mlp(x.requires_grad_())
        assert calls == []  # grad needed: the impl's own autograd path
        x = x.detach()
        outputs = []
        for context in (torch.no_grad, torch.inference_mode):
            with context():
                outputs.append(mlp(x))
        mlp.requires_grad_(False)  # grad mode on, but nothing to differentiate
        outputs.append(mlp(x))
    chunk = 16 if impl == "save_factors" else None
    assert calls == [chunk] * 3
    for y in outputs:
        assert y.grad_fn is None and y.shape == trained.shape
        torch.testing.assert_close(y, trained.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_fused_mlp_op_registration(device, backend):
    """Schema, fake (meta) kernel and dispatch of the custom op, as torch.compile relies on."""
    w1, b1, w2, b2 = _canonical(device, bias=True)
    x = torch.randn(3, D, device=device)
    torch.library.opcheck(inference.fused_mlp, (x, w1, b1, w2, b2))
    torch.library.opcheck(inference.fused_mlp, (x, w1, None, w2, None))


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", ["drop_h", "save_factors"])
@pytest.mark.parametrize("m", [3, 40], ids=["small-M", "large-M"])
def test_inference_path_under_torch_compile_fullgraph(device, backend, impl, m):
    """The dispatch traces: the fused_mlp and gated_fwd ops are opaque nodes with fake kernels."""
    torch._dynamo.reset()
    mlp = ParMLP(D, FFN, bias=True, impl=impl, chunk=16, device=device).eval()
    x = torch.randn(m, D, device=device)
    backend_name = "inductor" if device == "cuda" else "aot_eager"
    with use_backend(backend), torch.no_grad():
        expected = mlp(x)
        actual = torch.compile(mlp, fullgraph=True, backend=backend_name)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
