"""drop_h's fc1 weight gradient with x's rows read inside the GEMM (``gathered_wgrad=True``,
``kernels.experts_wgrad``): the GEMM against float64 at the routing's edges, with and without
the router weight on the input; drop_h with it against gathering first; and its backward, which
no longer gathers x. drop_h with it against float64 and compiled: tests/test_experts.py."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_backends, device_backends
from helpers import rel_err
from test_experts import NAMES, inputs, run
from torch.utils._python_dispatch import TorchDispatchMode

from swiglu_train.kernels.runtime import triton_runs_on
from swiglu_train.ops import experts_routing
from swiglu_train.ops.activation import use_backend
from swiglu_train.ops.experts import experts_mlp
from swiglu_train.ops.experts_routing import gathered_weight_grad

# rows per expert: empty first, in the middle and last; none a multiple of the 16-row step
SIZES = [0, 5, 37, 0, 19, 1, 0]
T, N, K = 23, 48, 40


def operands(dtype: torch.dtype, device: str, scaled: bool):
    """a [R, N] sorted by expert, b [T, K], token [R] (tokens repeat), offsets, scale."""
    g = torch.Generator().manual_seed(0)
    rows = sum(SIZES)
    a = torch.randn(rows, N, generator=g).to(dtype)
    b = torch.randn(T, K, generator=g).to(dtype)
    token = torch.randint(0, T, (rows,), generator=g)
    offsets = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    scale = torch.rand(rows, generator=g) if scaled else None
    return [t if t is None else t.to(device) for t in (a, b, token, offsets, scale)]


def float64_truth(a, b, token, offsets, scale) -> torch.Tensor:
    """Per expert, its rows of a times the gathered (scaled, rounded as in forward) rows of b."""
    rows = b.index_select(0, token)
    if scale is not None:
        rows = rows * scale.to(b.dtype)[:, None]
    out, start = [], 0
    for end in offsets.tolist():
        out.append(a[start:end].double().t() @ rows[start:end].double())
        start = end
    return torch.stack(out)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("in_gemm", [True, False], ids=["in_gemm", "gathered_first"])
def test_matches_float64_with_empty_experts_and_odd_row_counts(
    device, backend, dtype, scaled, in_gemm
):
    a, b, token, offsets, scale = operands(dtype, device, scaled)
    with use_backend(backend):
        out = gathered_weight_grad(a, b, token, offsets, scale, in_gemm)
    assert out.shape == (len(SIZES), N, K) and out.dtype == dtype
    truth = float64_truth(a, b, token, offsets, scale)
    # fp32: summation order only. bf16: two roundings, of w·x and of the output, each under
    # 2^-7 relative where the interpreter truncates them (it does not round to nearest)
    assert rel_err(out, truth) < (1e-6 if dtype == torch.float32 else 2**-6)
    empty = [e for e, size in enumerate(SIZES) if size == 0]
    assert out[empty].abs().max() == 0  # written as zeros, never left as old memory


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_reads_a_strided_input_and_no_rows_give_zeros(device, backend):
    a, b, token, offsets, _ = operands(torch.float32, device, False)
    strided = b.t().contiguous().t()  # same values, column stride T
    with use_backend(backend):
        out = gathered_weight_grad(a, strided, token, offsets, None, True)
        none = gathered_weight_grad(a[:0], b, token[:0], offsets * 0, None, True)
    assert rel_err(out, float64_truth(a, b, token, offsets, None)) < 1e-6
    assert none.shape == (len(SIZES), N, K) and none.abs().max() == 0


@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_an_int32_token_gives_the_int64_tokens_sums(device, backend):
    """Backward's plan keeps the token in int32 (4 bytes a row less at the peak); the kernel
    widens it before it scales a row index."""
    a, b, token, offsets, scale = operands(torch.float32, device, True)
    with use_backend(backend):
        wide = gathered_weight_grad(a, b, token, offsets, scale, True)
        narrow = gathered_weight_grad(a, b, token.to(torch.int32), offsets, scale, True)
    assert (
        torch.equal(wide, narrow)
        and rel_err(wide, float64_truth(a, b, token, offsets, scale)) < 1e-6
    )


@pytest.mark.parametrize(("device", "backend"), cpu_backends())
@pytest.mark.parametrize("on", ["output", "input"])
def test_fp32_equals_gathering_first_to_rounding(device, backend, on):
    """The same sums in another order: fp32 y and every gradient agree with gathering first to
    rounding (bf16 against float64, and compiled against eager: test_experts' WITH_OPTIONS)."""
    x, idx, w, fc1, fc2, grad_y = inputs(24, 32, 40, 5, 2, torch.float32, True)
    first = run("drop_h", False, on, x, idx, w, fc1, fc2, grad_y, backend)
    inside = run("drop_h", False, on, x, idx, w, fc1, fc2, grad_y, backend, gathered_wgrad=True)
    for name, a, b in zip(NAMES, inside, first, strict=True):
        assert rel_err(a, b) < 1e-6, name


class _Gathers(TorchDispatchMode):
    """Records the storage of every tensor whose rows ``index_select`` gathers, and how many."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[tuple[int, int]] = []

    def rows_of(self, t: torch.Tensor) -> list[int]:
        return [n for ptr, n in self.sources if ptr == t.untyped_storage().data_ptr()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_select.default:
            self.sources.append((args[0].untyped_storage().data_ptr(), args[2].numel()))
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("on", ["output", "input"])
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered_wgrad", "gather_first"])
def test_backward_gathers_x_only_where_its_rows_are_needed_written(on, gathered, monkeypatch):
    """x's rows in backward. With gathered_wgrad, grad_W1 reads them inside its GEMM: x is
    gathered only where the router weight scales the input, for that weight's gradient, a
    DOT_CHUNK at a time, so no [R, D] copy is ever whole. Gathering first, one gather of all R
    rows serves grad_W1 and, on the input side, the weight's gradient too (Llama-4 gathered
    twice before)."""
    monkeypatch.setattr(experts_routing, "DOT_CHUNK", 16 * 32)  # 16 rows of D = 32 a chunk
    x, idx, w, fc1, fc2, grad_y = inputs(40, 32, 24, 4, 2, torch.float32)
    for leaf in (x, w, fc1, fc2):
        leaf.requires_grad_()
    with use_backend("triton"):
        y = experts_mlp(x, idx, w, fc1, fc2, "drop_h", weights_on=on, gathered_wgrad=gathered)
        with _Gathers() as gathers:
            y.backward(grad_y)
    rows = 40 * 2
    expected = {(True, "output"): [], (True, "input"): [16] * (rows // 16)}
    assert gathers.rows_of(x) == expected.get((gathered, on), [rows]), gathers.sources
    assert gathers.rows_of(grad_y) == [rows]  # grad_y's rows
    assert all(leaf.grad is not None for leaf in (x, w, fc1, fc2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"b": torch.zeros(T, K, dtype=torch.float64)}, "one dtype and device"),
        ({"token": torch.zeros(sum(SIZES), dtype=torch.int16)}, "token must be int32 or int64"),
        ({"offsets": torch.tensor(SIZES).cumsum(0)}, "offsets must be int32"),
        ({"scale": torch.ones(3)}, f"scale must be [{sum(SIZES)}]"),
    ],
)
def test_kernel_refuses_bad_operands_in_one_line(change, message):
    kernels = pytest.importorskip("swiglu_train.kernels.experts_wgrad")
    a, b, token, offsets, scale = operands(torch.float32, "cpu", False)
    args = {"a": a, "b": b, "token": token, "offsets": offsets, "scale": scale} | change
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        kernels.gathered_weight_grad(**args)
