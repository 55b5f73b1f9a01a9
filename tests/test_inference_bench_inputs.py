"""bench-inference's inputs: a bad --merge file or model size is refused in one line that says
what is wrong, before the run or the refit trips over it."""

import json

import pytest
from typer.testing import CliRunner

from swiglu_train.bench.inference import dispatch as fit
from swiglu_train.bench.inference import run as bench
from swiglu_train.cli import app


def _part(model: str = "a", k: int = 8) -> dict:
    rows = [
        {"table": "mlp", "model": model, "K": k, "N": 2 * k, "M": 1}
        | {"fused_mlp_ms": 0.5, "gated_linear_ms": 1.0, "eager_ms": 2.0}
        | {"fused_mlp_speedup_vs_eager": 4.0, "gated_linear_speedup_vs_eager": 2.0}
    ]
    return {"gpu": "H200", "commit": "abc", "meta": {"dtype": "bf16"}, "rows": rows}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 2], "run 2 of 2: expected a bench-inference --json result (an object), got list"),
        ({}, "run 2 of 2: not a bench-inference --json result: missing keys"),
        (  # a dispatch table passed by mistake
            {"schema": 1, "gpu": "H200", "commit": "abc", "dtype": "bf16", "shapes": {}},
            "missing keys ['meta', 'rows']",
        ),
        (_part() | {"meta": []}, "run 2 of 2: its meta has no dtype"),
        (_part() | {"rows": "abc"}, "run 2 of 2: its rows are not a list"),
        (_part() | {"rows": [{"table": "mlp"}]}, "run 2 of 2: rows[0] is not a bench row"),
        (_part() | {"rows": ["x"]}, "rows[0] is not a bench row"),
    ],
)
def test_merge_refuses_what_is_not_a_bench_result(bad, message):
    with pytest.raises(ValueError) as raised:
        fit.merge_results([_part("b", 16), bad])
    assert message in str(raised.value)


def test_merge_refuses_one_shape_measured_under_two_model_names():
    with pytest.raises(ValueError, match=r"mlp 8x16 at M=1 is measured twice, as 'a' and 'b'"):
        fit.merge_results([_part("a", 8), _part("b", 8)])
    assert len(fit.merge_results([_part("a", 8), _part("b", 16)])["rows"]) == 2


def test_cli_merge_of_a_bad_file_is_one_line(tmp_path):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(_part()))
    bad.write_text("[1, 2]")
    result = CliRunner().invoke(
        app, ["bench-inference", "--merge", str(good), str(bad)], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2, result.output
    assert "run 2 of 2: expected a bench-inference --json result" in result.output
    assert isinstance(result.exception, SystemExit)  # a usage error, not a traceback


@pytest.mark.parametrize("name", ["0x16", "16x0", "00x16", "8x1\u0666"])  # \u0666: a 6
def test_a_zero_size_model_is_refused_before_running(name):
    with pytest.raises(ValueError, match="D, F positive"):
        bench.parse_model(name)
    result = CliRunner().invoke(app, ["bench-inference", "--device", "cpu", "--models", name])
    assert result.exit_code == 2 and f"unknown model '{name}'" in result.output
