"""impl="auto": the table rule, its fallbacks, the packaged table, and the layout it builds."""

import copy
import json
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import crossover_table, pretend_gpu

from swiglu_train import ParMLP
from swiglu_train.layers import auto
from swiglu_train.layers.auto import CrossoverTable, ImplStats, TableError, choose, resolve
from swiglu_train.layers.registry import MLP_IMPLS, PACKED_IMPLS

ROOT = Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"
FAST_SF = {"normal": (1.10, 900.0), "drop_h": (1.09, 600.0), "save_factors": (1.02, 700.0)}
FAST_NORMAL = {"normal": (1.03, 900.0), "drop_h": (1.06, 600.0), "save_factors": (1.08, 700.0)}
# M steps x4 (log2 gap 2), D and F one gap each: (2048, 5632) -> (4096, 11008)
GRID = {
    (2048, 2048, 5632): FAST_SF,
    (8192, 2048, 5632): FAST_NORMAL,
    (2048, 4096, 11008): FAST_NORMAL,
    (8192, 4096, 11008): FAST_SF,
}


def table(points: dict = GRID, family: str = "H200") -> CrossoverTable:
    return CrossoverTable.from_dict(crossover_table(points, family))


@pytest.mark.parametrize(
    ("m", "d", "f", "expected", "where"),
    [
        (3000, 2048, 5632, "save_factors", "M=2048, D=2048"),  # log2 distance 0.55 vs 1.45
        (6000, 2048, 5632, "normal", "M=8192, D=2048"),
        (2048, 3584, 11008, "normal", "M=2048, D=4096"),
        (16384, 4096, 14336, "save_factors", "M=8192, D=4096"),  # beyond the grid, in a step
    ],
)
def test_nearest_point_in_log_space(m, d, f, expected, where):
    resolution = resolve(m, d, f, H200, table())
    assert resolution.impl == expected
    assert where in resolution.reason and "commit abc1234" in resolution.reason
    assert "NVIDIA H200 in bf16," in resolution.reason  # a fp32 or fp16 model sees what it got


@pytest.mark.parametrize(("drop_h_ratio", "expected"), [(1.0099, "drop_h"), (1.0101, "normal")])
def test_within_one_percent_the_lower_memory_wins(drop_h_ratio, expected):
    impls = {"normal": (1.0, 900.0), "drop_h": (drop_h_ratio, 600.0), "save_factors": (1.2, 1.0)}
    assert resolve(4096, 4096, 11008, H200, table({(4096, 4096, 11008): impls})).impl == expected


@pytest.mark.parametrize("quack_here", [False, True], ids=["no_quack", "quack"])
def test_impls_this_machine_cannot_run_are_left_out(monkeypatch, quack_here):
    """drop_h_quack is chosen only where quack runs; elsewhere the next best, and a point
    that measured nothing runnable falls back."""
    monkeypatch.setattr(auto, "quack_available", lambda: quack_here)
    impls = {"normal": (1.05, 990.0), "drop_h": (1.07, 686.0), "drop_h_quack": (1.01, 686.0)}
    resolution = resolve(4096, 4096, 11008, H200, table({(4096, 4096, 11008): impls}))
    assert resolution.impl == ("drop_h_quack" if quack_here else "normal")
    only_quack = table({(4096, 4096, 11008): {"drop_h_quack": (1.01, 686.0)}})
    resolution = resolve(4096, 4096, 11008, H200, only_quack)
    assert resolution.impl == ("drop_h_quack" if quack_here else "drop_h")
    assert quack_here or "can run here" in resolution.reason
    odd_ffn = table({(4096, 4096, 11004): impls})  # F not a multiple of 8: quack cannot take it
    assert resolve(4096, 4096, 11004, H200, odd_ffn).impl == "normal"


def test_quack_impls_need_an_aligned_output_size_too(monkeypatch):
    """quack's kernels refuse an fc2 output size that is not a multiple of 8 at forward, so
    auto must not pick them for such a layer (the table has no O: it measured O = D)."""
    monkeypatch.setattr(auto, "quack_available", lambda: True)
    impls = {"normal": (1.05, 990.0), "drop_h": (1.07, 686.0), "drop_h_quack": (1.01, 686.0)}
    grid = table({(4096, 4096, 11008): impls})
    assert resolve(4096, 4096, 11008, H200, grid, output_size=4096).impl == "drop_h_quack"
    assert resolve(4096, 4096, 11008, H200, grid, output_size=4100).impl == "normal"


def test_choose_explains_a_memory_tie_break():
    stats = {"normal": ImplStats(10.0, 1.0, 990.0), "drop_h": ImplStats(10.05, 1.005, 685.0)}
    impl, why = choose(stats)
    assert impl == "drop_h"
    assert "within 1% of normal" in why and "685 vs 990 MiB" in why
    assert choose({"normal": stats["normal"]}) == ("normal", "fastest (1.000x floor)")


@pytest.mark.parametrize(
    ("m", "d", "f", "device_name", "table_", "why"),
    [
        (400, 2048, 5632, H200, table(), "M=400 is more than one grid step (x4.00)"),
        (40000, 4096, 11008, H200, table(), "M=40000 is more than one grid step"),
        (8192, 16384, 11008, H200, table(), "D=16384 is more than one grid step (x2.00)"),
        (None, 2048, 5632, H200, table(), "no tokens_hint"),
        (2048, 2048, 5632, None, table(), "not on a CUDA device"),
        (
            2048,
            2048,
            5632,
            "NVIDIA A100-SXM4-80GB",
            table(),
            "no crossover table for GPU family 'A100'",
        ),
        (2048, 2048, 5632, H200, None, "no crossover table for GPU family 'H200'"),
    ],
)
def test_fallback_is_drop_h_with_a_reason(m, d, f, device_name, table_, why):
    resolution = resolve(m, d, f, device_name, table_)
    assert resolution.impl == "drop_h"
    assert resolution.reason.startswith("fallback to drop_h: ") and why in resolution.reason


def test_edge_of_range_is_exactly_one_step():
    assert resolve(512, 2048, 5632, H200, table()).impl == "save_factors"  # x4 below: in
    assert "fallback" in resolve(511, 2048, 5632, H200, table()).reason


@pytest.mark.parametrize("hint", [0, -5, True, 2048.5, "2048"])
def test_bad_tokens_hint(hint):
    """A fraction of a token or a string (from a YAML or CLI) is named, not compared or used."""
    with pytest.raises(ValueError, match="tokens_hint must be a positive token count"):
        resolve(hint, 2048, 5632, H200, table())


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA GeForce RTX 4090", "4090"),
    ],
)
def test_gpu_family(name, family):
    assert auto.gpu_family(name) == family


def test_packaged_table_is_the_measured_grid_and_ships_as_package_data(monkeypatch):
    monkeypatch.setattr(auto, "quack_available", lambda: True)  # as on the H200 that measured it
    packaged = auto.packaged_table("H200")
    measured = json.loads((ROOT / "benchmarks/results/crossover_h200.json").read_text())
    assert packaged is not None and packaged.gpu_family == "H200"
    assert packaged.commit == measured["meta"]["commit"]
    rows = {(r["M"], r["D"], r["F"], r["impl"]): r for r in measured["rows"]}
    assert {p.dims for p in packaged.points} == {k[:3] for k in rows}
    for point in packaged.points:  # the table is the run's numbers, and auto reads them
        assert set(point.impls) == set(MLP_IMPLS)
        for impl, stats in point.impls.items():
            row = rows[(*point.dims, impl)]
            assert stats.ratio_to_floor == pytest.approx(row["ratio_to_floor"], abs=1e-4)
            assert row["auto_choice"] == (impl == auto.choose(point.impls)[0])
        assert resolve(*point.dims, H200, packaged).impl == auto.choose(point.impls)[0]
    assert auto.packaged_table("B200") is None
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert any(
        (ROOT / "swiglu_train/layers").glob(g) for g in globs["package-data"]["swiglu_train.layers"]
    )


def _malformed(path: str, value) -> dict:
    """The synthetic table with one entry replaced (or deleted, for value=KeyError)."""
    raw = copy.deepcopy(crossover_table(GRID))
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("commit", KeyError, r"top level: missing keys \['commit'\]"),
        ("extra", 1, r"unknown keys \['extra'\]"),
        ("schema", 2, "schema: expected 1, got 2"),
        ("gpu_family", "", "gpu_family: expected a non-empty string"),
        ("points", [], "points: expected a non-empty list"),
        ("points.0.M", -1, r"points\[0\]\.M: expected a positive integer, got -1"),
        ("points.0.D", True, r"points\[0\]\.D: expected a positive integer, got True"),
        ("points.1.impls", {}, r"points\[1\]\.impls: expected a non-empty object"),
        ("points.1.impls.fast", {}, r"unknown impls \['fast'\]; valid: normal, drop_h"),
        ("points.2.impls.drop_h.ms", float("nan"), r"drop_h\.ms: expected a finite number > 0"),
        ("points.2.impls.normal.after_forward_MiB", -1, r"after_forward_MiB: .* >= 0"),
        ("points.3.impls.normal.peak_MiB", 1, "exactly the keys ms, ratio_to_floor"),
        ("points.3.M", 2048, r"points: the same \(M, D, F\) appears twice"),
    ],
)
def test_malformed_table_names_the_problem(path, value, message):
    with pytest.raises(TableError, match=message):
        CrossoverTable.from_dict(_malformed(path, value), "test.json")


def test_unreadable_table_file(tmp_path):
    bad = tmp_path / "crossover_h200.json"
    bad.write_text('{"schema": 1,')
    with pytest.raises(TableError, match=r"crossover_h200\.json: not valid JSON"):
        auto.read_table(bad)
    bad.write_text(json.dumps(_malformed("schema", 3)))
    with pytest.raises(TableError, match=r"crossover_h200\.json: schema: expected 1, got 3"):
        auto.read_table(bad)


def test_auto_on_cpu_is_drop_h_with_canonical_layout():
    mlp = ParMLP(16, 40, impl="auto", tokens_hint=2048, device="cpu")
    assert mlp.impl == "drop_h" and not mlp.fc1_layout.packed
    assert "not on a CUDA device" in mlp.auto_reason
    assert "impl='drop_h' (auto)" in repr(mlp)
    assert ParMLP(16, 40, impl="drop_h").auto_reason is None


def test_auto_resolving_to_save_factors_builds_the_packed_layout(monkeypatch):
    pretend_gpu(monkeypatch, crossover_table({(64, 16, 40): FAST_SF}))
    mlp = ParMLP(16, 40, impl="auto", tokens_hint=64)
    assert mlp.impl == "save_factors" and mlp.fc1_layout.packed
    assert "save_factors: fastest" in mlp.auto_reason
    assert mlp.state_dict()["_extra_state"]["fc1_layout"]["kind"] == "packed"
    plain = ParMLP(16, 40, impl="normal")
    plain.load_state_dict(mlp.state_dict())  # converts packed -> canonical on load
    x = torch.randn(5, 16)
    torch.testing.assert_close(mlp(x), plain(x))
    mlp.set_impl("drop_h")
    assert mlp.auto_reason is None  # a named impl is no longer auto's choice


def test_a_layer_whose_output_quack_cannot_take_gets_no_quack_impl(monkeypatch):
    """ParMLP passes its fc2 output size to auto: quack refuses O % 8 != 0 at forward (before,
    auto picked drop_h_quack here, which needs quack even to build)."""
    monkeypatch.setattr(auto, "quack_available", lambda: True)
    quack_fastest = {"normal": (1.05, 990.0), "drop_h_quack": (1.01, 686.0)}
    pretend_gpu(monkeypatch, crossover_table({(64, 16, 40): quack_fastest}))
    mlp = ParMLP(16, 40, output_size=20, impl="auto", tokens_hint=64, device="meta")
    assert mlp.impl == "normal"


def test_auto_resolving_to_normal_is_canonical(monkeypatch):
    pretend_gpu(monkeypatch, crossover_table({(64, 16, 40): FAST_NORMAL}))
    mlp = ParMLP(16, 40, impl="auto", tokens_hint=80)
    assert mlp.impl == "normal" and not mlp.fc1_layout.packed


def test_auto_uses_the_table_of_its_own_gpu_family(monkeypatch):
    pretend_gpu(monkeypatch, crossover_table({(64, 16, 40): FAST_SF}), "NVIDIA L40S")
    mlp = ParMLP(16, 40, impl="auto", tokens_hint=64)
    assert mlp.impl == "drop_h" and "GPU family 'L40S'" in mlp.auto_reason


def test_impl_names_list_auto_where_a_user_chooses():
    with pytest.raises(
        ValueError,
        match="valid impls: normal, drop_h, save_factors, drop_h_quack, save_factors_quack, auto",
    ):
        ParMLP(8, 16, impl="fast")
    mlp = ParMLP(8, 16)
    with pytest.raises(ValueError, match="resolved once, when a ParMLP is built"):
        mlp.impl = "auto"  # after construction the layout is fixed: name a concrete impl
    assert mlp.impl == "drop_h"


def test_lightning_model_builds_auto_layers():
    pytest.importorskip("lightning")
    from swiglu_train.integrations.lightning.model import LlamaDecoder, ModelConfig

    model = LlamaDecoder(
        ModelConfig(hidden_size=32, ffn_hidden_size=64, num_heads=2, mlp_impl="auto")
    )
    assert {layer.mlp.impl for layer in model.layers} == {"drop_h"}  # CPU: the fallback
    assert all(layer.mlp.auto_reason for layer in model.layers)


def test_pretrain_rejects_unknown_impl_listing_auto():
    pytest.importorskip("lightning")
    from swiglu_train.integrations.lightning.config import PretrainConfig
    from swiglu_train.integrations.lightning.pretrain import run_pretrain

    cfg = PretrainConfig()
    cfg.model.mlp_impl = "fastest"
    with pytest.raises(ValueError, match=r"unknown MLP impl 'fastest'.*save_factors_quack, auto"):
        run_pretrain(cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_this_gpu_resolves_from_its_packaged_table():
    name = torch.cuda.get_device_name()
    mlp = ParMLP(3584, 14336, impl="auto", tokens_hint=11136, device="cuda", dtype=torch.bfloat16)
    if auto.packaged_table(auto.gpu_family(name)) is None:
        assert mlp.impl == "drop_h" and "no crossover table" in mlp.auto_reason
    else:
        assert "nearest measured point" in mlp.auto_reason
        assert mlp.fc1_layout.packed == (mlp.impl in PACKED_IMPLS)
    x = torch.randn(64, 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_quack_impl_auto_picked_runs_an_fp32_model_through_its_portable_twin():
    """The bf16 table resolves fp32 models too; one trained without autocast ran its fp32
    forward into quack's 'needs bf16 or fp16' TypeError (scripts/fuzz_gpu.py's table cases)."""
    from helpers import TOLERANCE, reference_outputs, rel_err, run_outputs

    from swiglu_train.layers.registry import QUACK_IMPLS
    from swiglu_train.ops.quack_mlp import quack_available

    if not quack_available():
        pytest.skip("quack does not run here")
    table = auto.packaged_table(auto.gpu_family(torch.cuda.get_device_name()))
    picks = [] if table is None else [
        (p.dims, auto.resolve_auto(p.M, p.D, p.F, "cuda").impl) for p in table.points
    ]  # fmt: skip
    quack_picks = [(dims, i) for dims, i in picks if i in QUACK_IMPLS]
    (m, d, f), impl = min(quack_picks, default=((0, 0, 0), None))
    if not impl:
        pytest.skip("auto picks no quack impl on this GPU's table")
    mlp = ParMLP(d, f, impl="auto", tokens_hint=m, device="cuda", dtype=torch.float32)
    assert mlp.impl == impl
    x, grad_y = torch.randn(61, d, device="cuda"), torch.randn(61, d, device="cuda")
    expected = reference_outputs(mlp, x, grad_y)
    actual = run_outputs(mlp, x, grad_y)
    for name in expected:
        assert rel_err(actual[name], expected[name]) < TOLERANCE[torch.float32], name
    named = ParMLP(64, 128, impl=impl, device="cuda")  # named explicitly, it still refuses
    with pytest.raises(TypeError, match="needs bf16 or fp16 tensors"):
        named(torch.randn(5, 64, device="cuda", requires_grad=True))
