"""The model grid's GEMM libraries: a cache of the grid's own, and ``--pretune`` (time the quack
impls' GEMMs at each point, then run the point on what won), recorded per point.

pretune itself times on CUDA with quack (tests/test_gemm_choice.py's GPU test); here a real
CPU grid run checks the wiring with the timing stood in for, and the refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swiglu_train.bench.grid import pretune as grid_pretune
from swiglu_train.bench.grid import run as grid
from swiglu_train.bench.grid.models import GridShape
from swiglu_train.bench.grid.plan import PRETUNE_POINT_S, GridConfig, GridPoint
from swiglu_train.bench.grid.report import to_markdown
from swiglu_train.bench.grid.run import run_grid
from swiglu_train.cli import app
from swiglu_train.ops import gemm_choice

SHAPE = GridShape(16, 40, ("a-1",), ("a",))


def quiet(label, total):
    return lambda: None


def test_the_grid_reads_a_cache_of_its_own_and_gives_the_user_s_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIGLU_TRAIN_CACHE_DIR", str(tmp_path))
    users = gemm_choice.record({"k": {"backend": "cublas"}})
    with grid_pretune.private_cache():
        inside = gemm_choice.cache_path()
        assert inside != users and not inside.exists()
    assert gemm_choice.cache_path() == users and json.loads(users.read_text())["choices"]
    monkeypatch.delenv("SWIGLU_TRAIN_CACHE_DIR")
    with grid_pretune.private_cache():
        assert os.environ["SWIGLU_TRAIN_CACHE_DIR"]
    assert "SWIGLU_TRAIN_CACHE_DIR" not in os.environ


@pytest.mark.parametrize(
    ("variants", "device", "why"),
    [
        (("normal", "drop_h"), "cuda", "none of the variants chooses GEMM libraries"),
        (("drop_h_quack", "quack"), "cpu", "pretune times GEMMs on CUDA only"),
    ],
)
def test_why_pretune_cannot_run(variants, device, why):
    assert grid_pretune.why_not(variants, device).startswith(why)
    assert grid_pretune.pretuned_impls(("drop_h_quack", "quack", "save_factors_quack")) == [
        "drop_h_quack",
        "save_factors_quack",
    ]


def test_pretune_is_charged_in_the_estimates():
    point = GridPoint(8000, GridShape(4096, 14336, ("llama3-8b",), ("llama3",)))
    cfg = GridConfig([point.shape], m=(8000,), variants=("drop_h_quack",))
    plain = cfg.estimate_s(point)
    cfg.pretune = True
    assert cfg.estimate_s(point) == pytest.approx(plain + PRETUNE_POINT_S)


def test_a_pretuned_run_times_each_point_s_gemms_first_and_records_them(monkeypatch):
    """A real CPU grid run with pretune's timing stood in for (it needs CUDA and quack): each
    point is pretuned before it is measured, in the grid's own cache, and records what won."""
    calls = []

    def fake_pretune(dims, variants, dtype):
        calls.append((dims, os.environ["SWIGLU_TRAIN_CACHE_DIR"]))
        return [{"gemm": "fc2", "backend": "quack_dynamic", "cublas_over_quack": 1.02,
                 "quack_dynamic_over_quack": 0.97}]  # fmt: skip

    monkeypatch.setattr(grid, "why_not", lambda variants, device: None)
    monkeypatch.setattr(grid, "pretune_point", fake_pretune)
    cfg = GridConfig([SHAPE], m=(24, 40), variants=("normal",), samples=2, warmup=1,
                     dtype="fp32", device="cpu", pretune=True)  # fmt: skip
    result = run_grid(cfg, quiet)
    assert [dims for dims, _ in calls] == [(24, 16, 40), (40, 16, 40)]
    assert len({cache for _, cache in calls}) == 1  # the run's own cache, gone after it
    assert not any(Path(cache).exists() for _, cache in calls)
    assert result["meta"]["gemm_choices"] == grid_pretune.PRETUNED
    assert [p["pretuned"][0]["backend"] for p in result["points"]] == ["quack_dynamic"] * 2
    text = to_markdown(result)
    assert f"ran on: {grid_pretune.PRETUNED}." in text
    assert "| 24 | 16 | 40 | fc2 | quack_dynamic | 1.020 | 0.970 |" in text


def test_a_point_whose_pretune_fails_is_timed_on_the_defaults_and_says_why(monkeypatch):
    def broken(dims, variants, dtype):
        raise RuntimeError("quack: no config for this layout\nmore detail")

    monkeypatch.setattr(grid, "why_not", lambda variants, device: None)
    monkeypatch.setattr(grid, "pretune_point", broken)
    cfg = GridConfig([SHAPE], m=(24,), variants=("normal",), samples=2, warmup=1,
                     dtype="fp32", device="cpu", pretune=True)  # fmt: skip
    result = run_grid(cfg, quiet)
    (point,) = result["points"]
    assert point["pretuned"] is None and {r["variant"] for r in result["rows"]} == {"normal"}
    assert point["pretune_error"] == "RuntimeError: quack: no config for this layout"
    assert "Pretune failed at [24, 16, 40] (timed on the defaults): RuntimeError" in (
        to_markdown(result)
    )


def test_cli_pretune_where_it_cannot_run_says_why_and_runs_the_defaults(tmp_path):
    out = tmp_path / "g.json"
    args = ["bench-grid", "--device", "cpu", "--dtype", "fp32", "--shapes", "16x40", "--m", "24"]
    args += ["--variants", "normal", "--samples", "2", "--warmup", "1", "--pretune"]
    result = CliRunner().invoke(app, [*args, "--json", str(out), "--md", str(tmp_path / "g.md")])
    assert result.exit_code == 0, result.output
    meta = json.loads(out.read_text())["meta"]
    assert meta["gemm_choices"] == grid_pretune.DEFAULTS
    assert meta["pretune_skipped"].startswith("none of the variants chooses GEMM libraries")
    assert (
        "--pretune was asked for, and skipped: none of the variants"
        in (tmp_path / "g.md").read_text()
    )
