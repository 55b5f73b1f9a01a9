"""impl="auto": the cost model's rule, its fallbacks, the model file's validation, and the
layout ParMLP builds from the pick."""

import copy
import json
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import auto_model, pretend_gpu

from swiglu_train import ParMLP
from swiglu_train.layers import auto
from swiglu_train.layers.auto import AutoModel, resolve
from swiglu_train.layers.auto_model import TableError
from swiglu_train.layers.registry import PACKED_IMPLS

ROOT = Path(__file__).resolve().parents[1]
H200 = "NVIDIA H200"
FAST_SF = {"normal": (1.10, 6.0), "drop_h": (1.09, 4.0), "save_factors": (1.02, 6.0)}
FAST_NORMAL = {"normal": (1.03, 6.0), "drop_h": (1.06, 4.0), "save_factors": (1.08, 6.0)}
SHAPE = (4096, 4096, 11008)  # (M, D, F): the floor's estimate is 4.16 ms at 800 TFLOP/s


def model(impls: dict, **kwargs) -> AutoModel:
    return AutoModel.from_dict(auto_model(impls, **kwargs))


def test_gpu_bound_the_fastest_predicted_wins_and_the_reason_says_so():
    resolution = resolve(*SHAPE, H200, model(FAST_NORMAL))
    assert resolution.impl == "normal"
    assert resolution.reason == (
        "normal: fastest predicted (1.030x the six-GEMM floor) at M=4096, D=4096, F=11008, "
        "by the cost model fitted on NVIDIA H200 in bf16, commit abc1234"
    )


def test_host_bound_the_least_host_work_wins():
    """drop_h queues a step in half normal's host time and runs 3 % slower on the GPU: at a
    small M the host decides, at a large one the GPU."""
    terms = {"normal": (1.00, 0.0, 2.0, 6.0), "drop_h": (1.03, 0.0, 1.0, 4.0)}
    small = resolve(64, 4096, 11008, H200, model(terms))  # floor ~0.065 ms: host-bound
    assert small.impl == "drop_h"
    assert "host-bound (queuing a step takes 1.00 ms, its GPU work 0.07 ms)" in small.reason
    assert resolve(16384, 4096, 11008, H200, model(terms)).impl == "normal"


def test_the_activation_share_falls_as_one_over_d():
    """save_factors_quack's GEMMs are 3 % slower but its activation passes cost a fifth of
    normal's: it wins at small D and loses at large D."""
    terms = {"normal": (1.00, 200.0, 1e-9, 6.0), "save_factors_quack": (1.03, 40.0, 1e-9, 6.0)}
    fitted = model(terms, ds=(2048, 8192))
    assert resolve(4096, 2048, 8192, H200, fitted, quack=True).impl == "save_factors_quack"
    assert resolve(4096, 8192, 28672, H200, fitted, quack=True).impl == "normal"
    predicted = fitted.predict(4096, 2048, 8192)
    assert predicted["normal"].ratio == pytest.approx(1.0 + 200 / 2048)


@pytest.mark.parametrize(("drop_h_c", "expected"), [(1.0049, "drop_h"), (1.0051, "normal")])
def test_within_half_a_percent_the_lower_memory_wins(drop_h_c, expected):
    impls = {"normal": (1.0, 6.0), "drop_h": (drop_h_c, 4.0), "save_factors": (1.2, 6.0)}
    resolution = resolve(*SHAPE, H200, model(impls))
    assert resolution.impl == expected
    if expected == "drop_h":  # 2·M·D + 4·M·F bytes against 2·M·D + 6·M·F
        assert (
            f"predicted {drop_h_c:.3f}x the six-GEMM floor, within 0.5% of normal (1.000x), "
            "with less after-forward memory (204 vs 290 MiB)"
        ) in resolution.reason


def test_equal_memory_goes_to_the_faster():
    impls = {"drop_h": (1.004, 4.0), "drop_h_quack": (1.0, 4.0), "normal": (1.002, 6.0)}
    assert resolve(*SHAPE, H200, model(impls), quack=True).impl == "drop_h_quack"


@pytest.mark.parametrize("quack_here", [False, True], ids=["no_quack", "quack"])
def test_impls_this_machine_cannot_run_are_left_out(monkeypatch, quack_here):
    """drop_h_quack is chosen only where quack runs; elsewhere the next best, and a model of
    nothing runnable falls back."""
    monkeypatch.setattr(auto, "quack_available", lambda: quack_here)
    impls = {"normal": (1.05, 6.0), "drop_h": (1.07, 4.0), "drop_h_quack": (1.01, 4.0)}
    assert resolve(*SHAPE, H200, model(impls)).impl == ("drop_h_quack" if quack_here else "normal")
    resolution = resolve(*SHAPE, H200, model({"drop_h_quack": (1.01, 4.0)}))
    assert resolution.impl == ("drop_h_quack" if quack_here else "drop_h")
    assert quack_here or "none of the impls the model knows can run here" in resolution.reason
    assert resolve(4096, 4096, 11004, H200, model(impls)).impl == "normal"  # F % 8 != 0


def test_quack_impls_need_an_aligned_output_size_too():
    """quack's kernels refuse an fc2 output size that is not a multiple of 8 at forward, so
    auto must not pick them for such a layer (the model has no O: it was fitted at O = D)."""
    impls = {"normal": (1.05, 6.0), "drop_h": (1.07, 4.0), "drop_h_quack": (1.01, 4.0)}
    fitted = model(impls)
    assert resolve(*SHAPE, H200, fitted, output_size=4096, quack=True).impl == "drop_h_quack"
    assert resolve(*SHAPE, H200, fitted, output_size=4100, quack=True).impl == "normal"


@pytest.mark.parametrize(
    ("m", "d", "device_name", "model_", "why"),
    [
        (4096, 1023, H200, model(FAST_SF, ds=(2048, 8192)),
         "D=1023 is outside the range the model reaches (1024 to 16384: within x2 of the D it "
         "was fitted at on NVIDIA H200)"),
        (4096, 16385, H200, model(FAST_SF, ds=(2048, 8192)), "D=16385 is outside the range"),
        (None, 4096, H200, model(FAST_SF), "no tokens_hint"),
        (4096, 4096, None, model(FAST_SF), "not on a CUDA device"),
        (4096, 4096, "NVIDIA A100-SXM4-80GB", model(FAST_SF),
         "no auto model for GPU family 'A100' (NVIDIA A100-SXM4-80GB)"),
        (4096, 4096, H200, None, "no auto model for GPU family 'H200'"),
    ],
)  # fmt: skip
def test_fallback_is_drop_h_with_a_reason(m, d, device_name, model_, why):
    resolution = resolve(m, d, 11008, device_name, model_)
    assert resolution.impl == "drop_h"
    assert resolution.reason.startswith("fallback to drop_h: ") and why in resolution.reason


def test_the_d_range_includes_its_edges():
    fitted = model(FAST_SF, ds=(2048, 8192))
    assert fitted.d_range == (1024, 16384)
    for d in fitted.d_range:
        assert resolve(4096, int(d), 11008, H200, fitted).impl == "save_factors"


@pytest.mark.parametrize("hint", [0, -5, True, 2048.5, "2048"])
def test_bad_tokens_hint(hint):
    """A fraction of a token or a string (from a YAML or CLI) is named, not compared or used."""
    with pytest.raises(ValueError, match="tokens_hint must be a positive token count"):
        resolve(hint, 4096, 11008, H200, model(FAST_SF))


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


def test_the_shipped_models_load_and_ship_as_package_data():
    """Their numbers are the fits of the committed grids (tests/test_auto_fit.py)."""
    for family in ("H200", "H100"):
        path = ROOT / "swiglu_train/layers" / auto.model_filename(family)
        assert auto.packaged_model(family) == AutoModel.from_dict(json.loads(path.read_text()))
        assert auto.packaged_model(family).gpu_family == family
    assert auto.model_filename("H200") == "auto_h200.json"
    assert auto.packaged_model("B200") is None
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    [pattern] = globs["package-data"]["swiglu_train.layers"]
    shipped = sorted(p.name for p in (ROOT / "swiglu_train/layers").glob(pattern))
    assert shipped == ["auto_h100.json", "auto_h200.json"]


def _malformed(path: str, value) -> dict:
    """The synthetic model with one entry replaced (or deleted, for value=KeyError)."""
    raw = copy.deepcopy(auto_model(FAST_SF))
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is KeyError:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("commit", KeyError, r"top level: missing keys \['commit'\]"),
        ("extra", 1, r"unknown keys \['extra'\]"),
        ("schema", 2, "schema: expected 1, got 2"),
        ("gpu_family", "", "gpu_family: expected a non-empty string"),
        ("command", None, "command: expected a non-empty string, got None"),
        ("floor_tflops", 0, "floor_tflops: expected a finite number > 0, got 0"),
        ("floor_tflops", True, "floor_tflops: expected a finite number > 0, got True"),
        ("points", [], "points: expected a non-empty list"),
        ("points.0", [4096, 16], r"points\[0\]: expected \[M, D, F\] .*, got \[4096, 16\]"),
        ("points.1.2", -1, r"points\[1\]: expected \[M, D, F\] of positive integers"),
        ("points.1", [4096, 16, 64], r"points: the same \[M, D, F\] appears twice"),
        ("impls", {}, "impls: expected a non-empty object"),
        ("impls.fast", {}, r"impls: unknown impls \['fast'\]; valid: normal, drop_h"),
        ("impls.normal.c", float("nan"), r"impls\.normal\.c: expected a finite number, got nan"),
        ("impls.normal.host_ms", 0, r"impls\.normal\.host_ms: .* > 0, got 0"),
        ("impls.drop_h.after_forward_per_mf", -1, r"per_mf: expected bytes per element >= 0"),
        ("impls.drop_h.gpu_points", 1, r"gpu_points: expected an integer >= 2, got 1"),
        ("impls.drop_h.peak", 1, "exactly the keys c, a, host_ms, after_forward_per_md"),
        ("impls.normal.a", -1e6, r"impls\.normal: c \+ a/D = 1\.1 \+ -1000000\.0/8 is not pos"),
    ],
)
def test_malformed_model_names_the_problem(path, value, message):
    with pytest.raises(TableError, match=message):
        AutoModel.from_dict(_malformed(path, value), "test.json")


def test_unreadable_model_file(tmp_path):
    from swiglu_train.layers.auto_model import read_model

    bad = tmp_path / "auto_h200.json"
    bad.write_text('{"schema": 1,')
    with pytest.raises(TableError, match=r"auto model .*auto_h200\.json: not valid JSON"):
        read_model(bad)
    bad.write_text(json.dumps(_malformed("schema", 3)))
    with pytest.raises(TableError, match=r"auto_h200\.json: schema: expected 1, got 3"):
        read_model(bad)


def test_auto_on_cpu_is_drop_h_with_canonical_layout():
    mlp = ParMLP(16, 40, impl="auto", tokens_hint=2048, device="cpu")
    assert mlp.impl == "drop_h" and not mlp.fc1_layout.packed
    assert "not on a CUDA device" in mlp.auto_reason
    assert "impl='drop_h' (auto)" in repr(mlp)
    assert ParMLP(16, 40, impl="drop_h").auto_reason is None


def test_auto_resolving_to_save_factors_builds_the_packed_layout(monkeypatch):
    pretend_gpu(monkeypatch, auto_model(FAST_SF))
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
    quack_fastest = {"normal": (1.05, 6.0), "drop_h_quack": (1.01, 4.0)}
    pretend_gpu(monkeypatch, auto_model(quack_fastest))
    mlp = ParMLP(16, 40, output_size=20, impl="auto", tokens_hint=64, device="meta")
    assert mlp.impl == "normal"


def test_auto_resolving_to_normal_is_canonical(monkeypatch):
    pretend_gpu(monkeypatch, auto_model(FAST_NORMAL))
    mlp = ParMLP(16, 40, impl="auto", tokens_hint=80)
    assert mlp.impl == "normal" and not mlp.fc1_layout.packed


def test_auto_uses_the_model_of_its_own_gpu_family(monkeypatch):
    pretend_gpu(monkeypatch, auto_model(FAST_SF), "NVIDIA L40S")
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
def test_auto_on_this_gpu_resolves_from_its_packaged_model():
    name = torch.cuda.get_device_name()
    mlp = ParMLP(3584, 14336, impl="auto", tokens_hint=11136, device="cuda", dtype=torch.bfloat16)
    if auto.packaged_model(auto.gpu_family(name)) is None:
        assert mlp.impl == "drop_h" and "no auto model" in mlp.auto_reason
    else:
        assert "by the cost model fitted on" in mlp.auto_reason
        assert mlp.fc1_layout.packed == (mlp.impl in PACKED_IMPLS)
    x = torch.randn(64, 3584, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mlp(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_quack_impl_auto_picked_runs_an_fp32_model_through_its_portable_twin():
    """The bf16 model resolves fp32 models too; one trained without autocast ran its fp32
    forward into quack's 'needs bf16 or fp16' TypeError (benchmarks/fuzz_gpu.py's auto cases)."""
    from helpers import TOLERANCE, reference_outputs, rel_err, run_outputs

    from swiglu_train.layers.registry import QUACK_IMPLS
    from swiglu_train.ops.quack_mlp import quack_available

    if not quack_available():
        pytest.skip("quack does not run here")
    shipped = auto.packaged_model(auto.gpu_family(torch.cuda.get_device_name()))
    points = [] if shipped is None else shipped.points
    picks = [((m, d, f), auto.resolve_auto(m, d, f, "cuda").impl) for m, d, f in points]
    quack_picks = [(dims, i) for dims, i in picks if i in QUACK_IMPLS]
    (m, d, f), impl = min(quack_picks, default=((0, 0, 0), None))
    if not impl:
        pytest.skip("auto picks no quack impl at this GPU model's points")
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
