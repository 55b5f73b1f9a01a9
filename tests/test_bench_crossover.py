"""The crossover benchmark: its pure pieces on fake timings, and the command on CPU."""

import json

import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.bench.grid import crossover
from swiglu_train.bench.grid.crossover import (
    CrossoverConfig,
    parse_m,
    parse_shapes,
    point_rows,
    to_markdown,
)
from swiglu_train.cli import app
from swiglu_train.layers.auto import AutoModel, resolve
from swiglu_train.layers.auto_fit import fit_auto_model

runner = CliRunner()


def measured(ratios: dict, memory: dict | None = None, floor_ms: float = 10.0) -> list[dict]:
    """Rows shaped like ``measure_layer``'s: the floor first, then each impl (GPU-bound)."""
    rows = [{"variant": "floor", "full_ms": floor_ms, "full_over_floor": 1.0}]
    for name, ratio in ratios.items():
        mib = None if memory is None else memory[name]
        rows.append(
            {
                "variant": name,
                "full_ms": floor_ms * ratio,
                "full_over_floor": ratio,
                "gpu_ms": floor_ms * ratio,
                "host_ms": 1.5,
                "after_forward_MiB": mib,
                "peak_MiB": None if mib is None else 2 * mib,
                "rel_err_vs_reference": 0.0 if name == "normal" else 1e-3,
            }
        )
    return rows


MEMORY = {"normal": 990.0, "drop_h": 685.0, "save_factors": 700.0}


def flags(rows: list[dict], flag: str) -> list[str]:
    return [r["impl"] for r in rows if r[flag]]


def test_point_rows_carry_the_measurements_and_flag_winners():
    rows = point_rows(
        (4096, 2048, 5632),
        measured({"normal": 1.05, "drop_h": 1.058, "save_factors": 1.07}, MEMORY),
    )
    assert [(r["M"], r["D"], r["F"], r["impl"]) for r in rows] == [
        (4096, 2048, 5632, "normal"),
        (4096, 2048, 5632, "drop_h"),
        (4096, 2048, 5632, "save_factors"),
    ]
    assert rows[1]["ms"] == pytest.approx(10.58) and rows[1]["floor_ms"] == 10.0
    assert rows[1]["peak_MiB"] == 1370.0 and rows[1]["rel_err_vs_reference"] == 1e-3
    assert rows[1]["gpu_ms"] == pytest.approx(10.58) and rows[1]["host_ms"] == 1.5
    assert flags(rows, "fastest") == ["normal"]
    assert flags(rows, "least_memory") == ["drop_h"]
    assert flags(rows, "rule_choice") == ["drop_h"]  # within 1 % of normal, less memory


def test_the_rule_s_choice_is_the_fastest_outside_the_tie():
    rows = point_rows((4096, 2048, 5632), measured({"normal": 1.05, "drop_h": 1.07}, MEMORY))
    assert flags(rows, "rule_choice") == flags(rows, "fastest") == ["normal"]


def test_without_memory_readings_nothing_is_least():
    rows = point_rows((24, 16, 40), measured({"normal": 2.0, "drop_h": 1.5}))
    assert flags(rows, "least_memory") == [] and flags(rows, "rule_choice") == ["drop_h"]


def result_with(points: dict, skipped: list | None = None) -> dict:
    rows = [r for p, ratios in points.items() for r in point_rows(p, measured(ratios, MEMORY))]
    meta = {
        "gpu_family": "H200",
        "device_name": "NVIDIA H200",
        "commit": "abc1234",
        "dtype": "bf16",
        "command": "swiglu-train bench-crossover",
        "impls": ["normal", "drop_h", "save_factors"],
    }
    return {"meta": meta, "rows": rows, "skipped": skipped or []}


def test_markdown_has_one_line_per_point_and_the_skips():
    result = result_with(
        {
            (2048, 2048, 5632): {"normal": 1.05, "drop_h": 1.058, "save_factors": 1.02},
            (4096, 2048, 5632): {"normal": 1.05, "drop_h": 1.09},
        },
        [{"M": 16384, "D": 8192, "F": 28672, "impl": None, "reason": "failed: OutOfMemoryError"}],
    )
    lines = to_markdown(result).splitlines()
    assert lines[0].startswith("| M | D | F | floor ms | normal | drop_h | save_factors |")
    assert lines[0].endswith("| fastest | least memory | rule's pick |")
    assert lines[2] == (
        "| 2048 | 2048 | 5632 | 10.000 | 1.050x, 990 MiB | 1.058x, 685 MiB | 1.020x, 700 MiB "
        "| save_factors | drop_h | save_factors |"
    )
    assert lines[3].endswith("| 1.090x, 685 MiB | — | normal | drop_h | normal |")
    assert lines[-1] == ("- skipped M=16384 D=8192 F=28672, every impl: failed: OutOfMemoryError")


def test_the_auto_model_fits_from_crossover_rows():
    """The same model format as bench-grid's, from the crossover's rows (impl, not variant)."""
    memory = {"normal": 990.0, "drop_h": 685.0}
    points = {
        (m, d, 4 * d): {"normal": 1.0 + 40 / d, "drop_h": 1.01 + 40 / d}
        for m in (8192, 16384)
        for d in (2048, 8192)  # the floor's step 3-70 ms: GPU-bound (host 1.5 ms)
    }
    rows = [
        r
        for (m, d, f), ratios in points.items()
        for r in point_rows((m, d, f), measured(ratios, memory, 18 * m * d * f / 8e11))
    ]
    result = result_with({})
    result["rows"] = rows
    model = AutoModel.from_dict(fit_auto_model(result, "swiglu-train bench-crossover"))
    assert model.commit == "abc1234" and model.floor_tflops == pytest.approx(800.0)
    assert model.impls["normal"].c == pytest.approx(1.0) and model.impls["drop_h"].a == 40
    assert resolve(4096, 2048, 8192, "NVIDIA H200", model).impl == "normal"


def test_the_auto_model_needs_cuda_readings():
    result = result_with({(2048, 2048, 5632): {"normal": 1.0}})
    result["meta"]["gpu_family"] = None
    with pytest.raises(ValueError, match="needs CUDA readings"):
        fit_auto_model(result, "fit")


def test_run_records_skips_and_keeps_going(monkeypatch):
    def fake_measure(cfg, progress):
        m, d, _, o = cfg.shape
        assert o == d and cfg.variants == crossover.default_impls() and cfg.stack_layers == 0
        if d == 8192:
            raise torch.OutOfMemoryError("CUDA out of memory.\nTried to allocate 2 GiB")
        failed = {"save_factors": "failed: OutOfMemoryError: x"} if m == 4096 else {}
        ratios = {"normal": 1.05, "drop_h": 1.04, "save_factors": 1.03}
        return measured({k: v for k, v in ratios.items() if k not in failed}), failed, "normal"

    monkeypatch.setattr(crossover, "measure_layer", fake_measure)
    ticks = []
    cfg = CrossoverConfig(m=(2048, 4096), shapes=((2048, 5632), (8192, 28672)), device="cpu")
    result = crossover.run_crossover(cfg, lambda label, total: lambda: ticks.append(label))
    assert len(ticks) == 4
    assert [(r["M"], r["impl"]) for r in result["rows"]] == [
        (2048, "normal"),
        (2048, "drop_h"),
        (2048, "save_factors"),
        (4096, "normal"),
        (4096, "drop_h"),
    ]
    assert [(s["M"], s["D"], s["impl"], s["reason"]) for s in result["skipped"]] == [
        (4096, 2048, "save_factors", "failed: OutOfMemoryError: x"),
        (2048, 8192, None, "failed: OutOfMemoryError: CUDA out of memory."),
        (4096, 8192, None, "failed: OutOfMemoryError: CUDA out of memory."),
    ]
    meta = result["meta"]
    assert meta["gpu_family"] is None and meta["shapes"] == [[2048, 5632], [8192, 28672]]
    assert meta["samples"] == 30 and meta["elapsed_s"] >= 0 and "1%" in meta["winner_rule"]


@pytest.mark.parametrize(
    ("value", "error"), [("", "positive"), ("0,2048", "positive"), ("2k", "integers")]
)
def test_parse_m_errors(value, error):
    with pytest.raises(ValueError, match=error):
        parse_m(value)


def test_parse_shapes():
    assert parse_shapes("2048x5632, 4096X11008") == ((2048, 5632), (4096, 11008))
    for bad in ("2048", "2048x0", "2048x5632x1", "ax5632", ""):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(bad)


def test_cli_help_shows_the_default_grid():
    result = runner.invoke(app, ["bench-crossover", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for text in ("2048,4096,8192,16384", "8192x28672", "--samples", "--auto-model", "--json"):
        assert text in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shapes", "2048"], "is not DxF"),
        (["--m", "0"], "positive token counts"),
        (["--dtype", "int8"], "dtype must be one of"),
        (["--device", "cpu", "--auto-model", "t.json"], "--auto-model is fitted from CUDA"),
    ],
)
def test_cli_rejects_bad_arguments(args, message):
    result = runner.invoke(app, ["bench-crossover", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output


def test_cli_smoke_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "crossover.json"
    args = ["bench-crossover", "--device", "cpu", "--dtype", "fp32", "--m", "24,40"]
    args += ["--shapes", "16x40", "--samples", "2", "--warmup", "1", "--json", str(out)]
    monkeypatch.setattr("sys.argv", ["swiglu-train", *args])  # what the result records
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert [(r["M"], r["impl"]) for r in payload["rows"]] == [
        (m, impl) for m in (24, 40) for impl in ("normal", "drop_h", "save_factors")
    ]
    assert all(r["ms"] > 0 and r["rel_err_vs_reference"] < 1e-5 for r in payload["rows"])
    assert payload["skipped"] == []
    assert payload["meta"]["command"] == "swiglu-train " + " ".join(args)
    assert "| 40 | 16 | 40 |" in out.with_suffix(".md").read_text()
