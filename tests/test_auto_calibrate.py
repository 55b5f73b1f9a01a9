"""impl="auto" on a GPU family this package ships no model for: the model calibrated on this
machine is read first and checked, and with none on CUDA one warning names the command."""

import json
import warnings
from pathlib import Path

import pytest
from helpers import auto_model
from test_bench_grid import as_h200, tiny_run  # noqa: F401  (the fixture, for getfixturevalue)
from typer.testing import CliRunner

from swiglu_train import ParMLP
from swiglu_train.cli import app
from swiglu_train.layers import auto
from swiglu_train.layers.auto_fit import fit_auto_model

H100 = "NVIDIA H100 80GB HBM3"
FAST_SF = {"normal": (1.10, 6.0), "drop_h": (1.09, 4.0), "save_factors": (1.02, 6.0)}
FAST_NORMAL = {"normal": (1.03, 6.0), "drop_h": (1.06, 4.0), "save_factors": (1.08, 6.0)}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A cache directory of the test's own, no shipped model, and nothing read or warned yet."""
    monkeypatch.setenv("SWIGLU_TRAIN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(auto, "packaged_model", lambda family: None)
    auto.calibrated_model.cache_clear()
    auto.warn_uncalibrated.cache_clear()
    yield tmp_path / "cache"
    auto.calibrated_model.cache_clear()
    auto.warn_uncalibrated.cache_clear()


def on_gpu(monkeypatch, device_name: str = H100) -> None:
    monkeypatch.setattr(auto, "target_device_name", lambda device: device_name)


def calibrate(cache: Path, model: dict, name: str = "auto_h100.json") -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / name
    path.write_text(json.dumps(model))
    return path


def test_the_calibration_lives_beside_pretune_s_gemm_cache(cache, monkeypatch):
    assert auto.calibration_path("H100") == cache / "auto_h100.json"
    monkeypatch.delenv("SWIGLU_TRAIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert auto.calibration_path("B200") == Path("/xdg/swiglu-train/auto_b200.json")


def test_a_model_calibrated_here_is_read_before_the_shipped_one(cache, monkeypatch):
    on_gpu(monkeypatch)
    calibrate(cache, auto_model(FAST_SF, family="H100"))
    shipped = auto.AutoModel.from_dict(auto_model(FAST_NORMAL, family="H100"))
    monkeypatch.setattr(auto, "packaged_model", lambda family: shipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a calibrated GPU is not announced
        mlp = ParMLP(16, 40, impl="auto", tokens_hint=64)
    assert mlp.impl == "save_factors" and mlp.fc1_layout.packed
    assert "by the cost model fitted on NVIDIA H100 in bf16" in mlp.auto_reason


def test_a_calibrated_model_of_another_family_is_refused_in_one_warning(cache, monkeypatch):
    on_gpu(monkeypatch)
    path = calibrate(cache, auto_model(FAST_SF, family="H200"))
    with pytest.warns(UserWarning) as caught:
        mlp = ParMLP(16, 40, impl="auto", tokens_hint=64)
        ParMLP(16, 40, impl="auto", tokens_hint=64)  # read once: no second warning
    assert mlp.impl == "drop_h"
    messages = [str(w.message) for w in caught]
    assert messages[0] == (
        f"auto model {path}: fitted on GPU family 'H200' (NVIDIA H200), not 'H100'; "
        "impl='auto' ignores it. Delete it, or calibrate this GPU with: "
        "swiglu-train bench-grid --calibrate"
    )
    assert len(messages) == 2 and messages[1].startswith("impl='auto' builds drop_h")


def test_an_unreadable_calibration_is_refused_and_the_run_goes_on(cache, monkeypatch):
    on_gpu(monkeypatch)
    path = calibrate(cache, {"schema": 1})
    with pytest.warns(UserWarning) as caught:
        assert auto.resolve_auto(64, 16, 40, None).impl == "drop_h"
    refused, uncalibrated = (str(w.message) for w in caught)
    assert refused.startswith(f"auto model {path}: top level: missing keys ")
    assert refused.endswith("; impl='auto' ignores it. Delete it, or calibrate this GPU with: "
                            "swiglu-train bench-grid --calibrate")  # fmt: skip
    assert uncalibrated.startswith("impl='auto' builds drop_h on GPU family 'H100'")


def test_no_model_on_cuda_says_once_a_family_what_it_built_and_how_to_calibrate(cache, monkeypatch):
    on_gpu(monkeypatch)
    with pytest.warns(UserWarning) as caught:
        layers = [ParMLP(16, 40, impl="auto", tokens_hint=64) for _ in range(3)]
    assert [str(w.message) for w in caught] == [
        "impl='auto' builds drop_h on GPU family 'H100': no auto model for it, neither "
        f"calibrated ({cache / 'auto_h100.json'}) nor shipped, so the impls cannot be compared "
        "there and drop_h (never slower than 'normal' beyond noise, h not saved) is the safe "
        "choice; calibrate this GPU with: swiglu-train bench-grid --calibrate"
    ]
    assert caught[0].filename == __file__  # points at the line that built the layer
    assert all(mlp.impl == "drop_h" for mlp in layers)
    assert layers[0].auto_reason == (
        f"fallback to drop_h: no auto model for GPU family 'H100' ({H100}); calibrate this GPU "
        "with: swiglu-train bench-grid --calibrate"
    )
    on_gpu(monkeypatch, "NVIDIA B200")
    with pytest.warns(UserWarning, match="on GPU family 'B200'"):
        ParMLP(16, 40, impl="auto", tokens_hint=64)


def test_off_cuda_auto_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ParMLP(16, 40, impl="auto", tokens_hint=64, device="cpu").impl == "drop_h"


runner = CliRunner()


def test_bench_grid_calibrate_writes_the_model_auto_reads(request, cache, tmp_path, monkeypatch):
    """--calibrate: the model fitted from the rows goes to this machine's cache, atomically
    (nothing else left there), and auto on that family reads it from then on."""
    h200 = as_h200(request.getfixturevalue("tiny_run"))
    chunk = tmp_path / "h200.json"
    chunk.write_text(json.dumps(h200))
    args = ["bench-grid", "--merge", str(chunk), "--calibrate"]
    monkeypatch.setattr("sys.argv", ["swiglu-train", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    written = json.loads((cache / "auto_h200.json").read_text())
    assert [p.name for p in cache.iterdir()] == ["auto_h200.json"]
    assert written["command"] == "swiglu-train " + " ".join(args)
    assert written == fit_auto_model(h200, written["command"])
    on_gpu(monkeypatch, "NVIDIA H200")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolution = auto.resolve_auto(40, 16, 40, None)
    assert "fitted on NVIDIA H200" in resolution.reason


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--auto-model", "a.json"], "give --auto-model or --calibrate, not both"),
        (["--device", "cpu"], "an auto model is fitted from CUDA readings: run with --device cuda"),
    ],
)
def test_bench_grid_calibrate_refuses_before_the_run(extra, error):
    result = runner.invoke(app, ["bench-grid", "--calibrate", *extra])
    assert result.exit_code == 2
    assert error in " ".join(result.output.split())


def test_the_grid_records_the_model_auto_read_calibrated_or_shipped(cache, monkeypatch):
    """bench-grid's in-sample flags come from the model ParMLP read, not the shipped one."""
    from swiglu_train.bench.grid.run import _model_summary

    shipped = auto.AutoModel.from_dict(auto_model(FAST_NORMAL, family="H100"))
    monkeypatch.setattr(auto, "packaged_model", lambda family: shipped)
    assert _model_summary("H100")["file"] == "auto_h100.json"
    path = calibrate(cache, auto_model(FAST_SF, family="H100"))
    auto.calibrated_model.cache_clear()
    summary = _model_summary("H100")
    assert summary["file"] == str(path)
    assert summary["points"] == [list(p) for p in auto.read_model(path).points]
