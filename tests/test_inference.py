"""The no-grad path: dispatch among fused MLP, gated GEMM + cuBLAS and torch, the measured
dispatch table it looks up, and ParMLP's use."""

import importlib.resources
import json
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import device_backends
from helpers import TOLERANCE, dispatch_table, rel_err

from swiglu_train import ParMLP
from swiglu_train.layers import PORTABLE_IMPLS
from swiglu_train.layers import par_mlp as par_mlp_module
from swiglu_train.layers.layout import CANONICAL, Layout, relayout
from swiglu_train.ops import dispatch, inference, reference, use_backend
from swiglu_train.ops.dispatch import DispatchTable, DispatchTableError
from swiglu_train.ops.quack_mlp import quack_serves, small_m_tile_n, wave_fill

ROOT = Path(__file__).resolve().parents[1]
TRITON = [p for p in device_backends() if p.values[1] == "triton"]
D, FFN = 32, 48


@pytest.fixture(autouse=True)
def _no_measured_table():
    """The default rules, whatever the shipped table holds; tests that need entries nest theirs."""
    with dispatch.use_table(dispatch_table()):
        yield


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
    small_m = dispatch.DEFAULT_FUSED_MLP_MAX_M
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
    monkeypatch.setattr(dispatch, "DEFAULT_GATED_MAX_M", 20)
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
def test_a_table_entry_changes_the_path_and_the_output_still_agrees(device, backend, taken):
    """Entries the opposite of the defaults: cuBLAS at M=1, the fused MLP at M=20 (the default
    rule would take fused_mlp, then gated); h alone follows the table's "gated" entries."""
    w1, b1, w2, b2 = _canonical(device, bias=True)
    shape = {"mlp": {1: "cublas", 8: "fused_mlp"}, "gated": {1: "cublas", 8: "gated"}}
    cases = {1: ("cublas", "swiglu_fwd", "cublas"), 20: ("fused_mlp", "fused_mlp", "gated")}
    with dispatch.use_table(dispatch_table({f"{D}x{FFN}": shape})):
        for m, (path, kernel, h_path) in cases.items():
            x = torch.randn(m, D, device=device).t().contiguous().t()  # column-major
            assert dispatch.default_path("mlp", m) != path
            assert inference.inference_path(x, w1, w2, None) == path
            taken.clear()
            y = inference.swiglu_mlp_inference(x, w1, b1, w2, b2, None)
            assert taken == [kernel]
            expected = reference.mlp(x.double(), w1.double(), b1.double(), w2.double(), b2.double())
            assert rel_err(y, expected) < TOLERANCE[torch.float32]
            assert inference.projection_path(x, w1, None) == h_path
            taken.clear()
            h = inference.swiglu_gated_projection(x, w1, b1, None)
            assert taken == ["swiglu_fwd" if h_path == "cublas" else "gated_fwd"]
            expected_h = reference.swiglu(torch.nn.functional.linear(x, w1, b1).double())
            assert rel_err(h, expected_h) < TOLERANCE[torch.float32]
        # where fused_mlp cannot serve (fc1 not row-major), the gated GEMM does
        x = torch.empty(20, D, device=device)
        assert inference.inference_path(x, w1.t().contiguous().t(), w2, None) == "gated"


def test_defaults_where_the_table_has_no_entry():
    """The rules from before the table: fused_mlp to 16 rows, gated to 4096, cuBLAS beyond."""
    mlp = [dispatch.choose("mlp", 896, 4864, m) for m in (1, 16, 17, 4096, 4097)]
    assert mlp == ["fused_mlp", "fused_mlp", "gated", "gated", "cublas"]
    gated = [dispatch.choose("gated", 896, 4864, m) for m in (1, 4096, 4097)]
    assert gated == ["gated", "gated", "cublas"]
    only_gated = dispatch_table({"896x4864": {"gated": {1: "cublas"}}})
    with dispatch.use_table(only_gated):  # no "mlp" entry anywhere: the mlp default applies
        assert dispatch.choose("mlp", 896, 4864, 1) == "fused_mlp"
        assert dispatch.choose("gated", 896, 4864, 4096) == "cublas"


def test_lookup_takes_the_nearest_m_in_log_space_ties_to_the_smaller():
    table = dispatch_table({"896x4864": {"mlp": {16: "fused_mlp", 64: "gated", 4096: "cublas"}}})
    with dispatch.use_table(table):
        # 32 and 512 are the geometric means (16·64, 64·4096): ties go to the smaller M
        expected = {1: "fused_mlp", 32: "fused_mlp", 33: "gated", 512: "gated", 513: "cublas"}
        expected[10**6] = "cublas"  # above every measured M: the largest
        assert {m: dispatch.choose("mlp", 896, 4864, m) for m in expected} == expected


def test_lookup_takes_the_nearest_shape_in_log_d_and_log_f():
    a, b = {"mlp": {1: "fused_mlp"}}, {"mlp": {1: "gated"}}
    table = dispatch_table({"1024x4096": a, "4096x16384": b, "512x65536": {"gated": {1: "gated"}}})
    with dispatch.use_table(table):
        queries = {
            (1024, 4096): "fused_mlp",  # measured
            (3584, 18944): "gated",  # Qwen-7B: nearest is 4096x16384
            (2048, 16384): "gated",  # log2 distances (1, 2) vs (1, 0)
            (2048, 8192): "fused_mlp",  # (1, 1) from both: ties go to the smaller D·F
            (512, 65536): "gated",  # 512x65536 has no mlp entry: the nearest that has one
            (16, 16): "fused_mlp",  # far below everything: still the nearest
        }
        assert {q: dispatch.choose("mlp", *q, 1) for q in queries} == queries
    # D and F are distances apart, not a product: same D·F, different shapes
    table = dispatch_table({"1024x16384": a, "4096x4096": b})
    with dispatch.use_table(table):
        assert dispatch.choose("mlp", 4096, 4096, 1) == "gated"
        assert dispatch.choose("mlp", 1024, 16384, 1) == "fused_mlp"


def test_a_quack_entry_serves_its_fallback_where_quack_cannot():
    """The table's "quack" path runs only where quack's kernel can take the call; elsewhere
    (here: no GPU, so no quack) the entry's fallback, the fit's pick without quack."""
    table = dispatch_table({"32x48": {"mlp": {1: "fused_mlp", 16: "quack"}}})
    table["shapes"]["32x48"]["mlp"]["16"]["fallback"] = "cublas"
    x, w1, w2 = torch.randn(60, 32), torch.randn(96, 32), torch.randn(32, 48)
    with dispatch.use_table(table), use_backend("triton"):
        asked = []
        assert dispatch.choose("mlp", 32, 48, 60, lambda: asked.append(1) or True) == "quack"
        assert dispatch.choose("mlp", 32, 48, 60) == "cublas"
        assert dispatch.choose("mlp", 32, 48, 1, lambda: asked.append(2) or True) == "fused_mlp"
        assert asked == [1]  # asked only where the table names quack
        assert not quack_serves(x, w1)
        assert inference.inference_path(x, w1, w2, None) == "cublas"
        actual = inference.swiglu_mlp_inference(x, w1, None, w2, None, None)
    expected = reference.mlp(x.double(), w1.double(), None, w2.double(), None)
    assert rel_err(actual, expected) < TOLERANCE[torch.float32]


def test_packaged_table_loads_and_ships_as_package_data():
    resource = importlib.resources.files("swiglu_train.ops") / dispatch.PACKAGED_TABLE
    raw = json.loads(resource.read_text())
    assert {"schema", "gpu", "commit", "dtype", "shapes"} <= set(raw)
    assert "H200" in raw["gpu"] and raw["dtype"] == "bf16"
    measured = json.loads((ROOT / "benchmarks/results/inference/inference_h200.json").read_text())
    assert raw["shapes"] == measured["dispatch"] and raw["commit"] == measured["commit"]
    assert isinstance(dispatch.packaged_table(), DispatchTable)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = globs["package-data"]["swiglu_train.ops"]
    assert any(Path(resource).match(g) for g in patterns)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("commit"), r"missing keys \['commit'\]"),
        (lambda t: t.update(schema=2), "schema: expected 1, got 2"),
        (lambda t: t["shapes"].update({"7b": {}}), r"shapes\.7b: expected DxF"),
        (lambda t: t["shapes"]["8x16"].update(decode={}), r"shapes\.8x16: expected DxF"),
        (lambda t: t["shapes"]["8x16"]["gated"]["1"].update(path="fused_mlp"), "gated.1"),
        (lambda t: t["shapes"]["8x16"]["mlp"].update({"0": {"path": "gated"}}), r"mlp\.0"),
        (lambda t: t["shapes"]["8x16"].update(mlp={}), "expected a non-empty object"),
        (lambda t: t["shapes"]["8x16"]["mlp"].update({"2": {"path": "quack"}}), "needs a 'fallb"),
        (lambda t: t["shapes"]["8x16"]["mlp"]["1"].update(fallback="gated"), "only a 'quack'"),
        (
            lambda t: t["shapes"]["8x16"]["gated"].update(
                {"2": {"path": "quack", "fallback": "fused_mlp"}}
            ),
            r"gated\.2: a 'quack' path needs a 'fallback' among \('gated', 'cublas'\)",
        ),
    ],
)
def test_malformed_table_names_the_problem(edit, message):
    """A table off schema raises, naming where, rather than misrouting calls (the "gated" kind,
    h alone, has no fused_mlp path)."""
    table = dispatch_table({"8x16": {"gated": {1: "gated"}, "mlp": {1: "fused_mlp"}}})
    DispatchTable.from_dict(table)  # well-formed before the edit
    edit(table)
    with pytest.raises(DispatchTableError, match=message):
        DispatchTable.from_dict(table, "test.json")


def test_use_table_reads_a_file_and_a_cold_table_loads_outside_compiled_graphs(
    tmp_path, monkeypatch
):
    """torch.compile(fullgraph=True) cannot trace file reads: the shape lookup is a trace-time
    constant, so the first lookup may come from inside a graph."""
    path = tmp_path / "inference_dispatch_test.json"
    path.write_text(json.dumps(dispatch_table({f"{D}x{FFN}": {"mlp": {1: "cublas"}}})))
    with dispatch.use_table(path):
        assert dispatch.choose("mlp", D, FFN, 1) == "cublas"
    monkeypatch.setattr(dispatch, "_override", None)

    def fn(x):
        return x * 2 if dispatch.choose("mlp", D, FFN, x.shape[0]) == "fused_mlp" else x * 3

    eager = {m: fn(torch.ones(m, 1)) for m in (1, 17)}
    dispatch.packaged_table.cache_clear()
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    for m, expected in eager.items():
        torch.testing.assert_close(compiled(torch.ones(m, 1)), expected)
    assert dispatch.packaged_table.cache_info().currsize == 1  # read while tracing


def test_grad_needed():
    x, w = torch.randn(2, 3), torch.randn(3, 3, requires_grad=True)
    assert inference.grad_needed(x, w, None)
    assert not inference.grad_needed(x, w.detach(), None)
    with torch.no_grad():
        assert not inference.grad_needed(x, w)
    with torch.inference_mode():
        assert not inference.grad_needed(x, w)


@pytest.mark.parametrize(("device", "backend"), device_backends())
@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
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


@pytest.mark.parametrize(
    ("m", "fc1_rows", "tile_n"),
    [  # Qwen-2.5 0.5B, 7B, 32B and 72B on 132 SMs
        (128, 9728, 96),  # 96 only at one M tile
        (128, 37888, 96),
        (256, 9728, 160),
        (384, 37888, 224),
        (128, 55296, 224),
        (128, 59136, 224),
        (512, 9728, 160),
        (512, 37888, None),
        (512, 55296, None),
        (512, 59136, 128),
        (640, 9728, None),  # past four M tiles, though a 160-wide tile would fill better
        (0, 59136, None),  # an empty batch: quack returns it as is
    ],
)
def test_quack_small_m_tile_fills_the_last_wave_best(m, fc1_rows, tile_n):
    """quack's default (128x192 tiles, clusters of two along M) idles half its CTAs at one M
    tile; at four, 7B's 198 column tiles fill 6 waves exactly and it stays, while 72B's 308
    leave the last of 10 waves a third empty and 128-wide tiles fill 14. Past 512 rows,
    where its M clusters halve the weight fetches, the default always stays."""
    assert small_m_tile_n(m, fc1_rows, 132) == tile_n


def test_wave_fill_counts_a_cluster_s_idle_ctas():
    assert wave_fill(1, 198, 2, 1, 132) == 0.5  # one M tile in clusters of two along M
    assert wave_fill(1, 237, 1, 2, 132) == 237 / 264  # 119 clusters: two waves of 66
    assert wave_fill(4, 198, 2, 1, 132) == 1.0
