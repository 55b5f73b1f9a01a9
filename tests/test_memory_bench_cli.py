"""bench-memory renders its JSON, table and plot before writing any: the three stay one run."""

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from swiglu_train.bench.memory import stack as memory_stack
from swiglu_train.cli import app


class _FailingFigure:
    """A figure whose rendering dies half-way (full disk, a killed process)."""

    def savefig(self, target, **kwargs) -> None:
        if isinstance(target, str | Path):
            with open(target, "wb") as f:
                f.write(b"\x89PN")
        else:
            target.write(b"\x89PN")
        raise OSError("No space left on device")


ARGS = ["bench-memory", "--device", "cpu", "--dtype", "fp32", "--shape", "8,16,24,16"]


def test_a_failed_plot_leaves_the_previous_run_s_files_untouched(tmp_path, monkeypatch):
    out = tmp_path / "stack.json"
    previous = {
        out: b'{"results": "previous run"}\n',
        out.with_suffix(".md"): b"| previous run |\n",
        out.with_suffix(".png"): b"\x89PNG previous run",
    }
    for path, content in previous.items():
        path.write_bytes(content)
    monkeypatch.setattr(memory_stack, "plot", lambda rows: _FailingFigure())
    result = CliRunner().invoke(app, [*ARGS, "--layers", "1", "--json", str(out)])
    assert isinstance(result.exception, OSError)
    assert {path: path.read_bytes() for path in previous} == previous  # no new JSON or table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stack.json", "stack.md", "stack.png"]


def test_a_failed_plot_on_a_first_run_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_stack, "plot", lambda rows: _FailingFigure())
    out = tmp_path / "results" / "stack.json"
    result = CliRunner().invoke(app, [*ARGS, "--layers", "1", "--json", str(out)])
    assert isinstance(result.exception, OSError)
    assert list(tmp_path.iterdir()) == []


def test_a_run_writes_the_three_files_of_one_result(tmp_path):
    out = tmp_path / "stack.json"
    result = CliRunner().invoke(app, [*ARGS, "--layers", "1,2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    rows = saved["results"]
    assert [(r["impl"], r["layers"]) for r in rows] == [
        (impl, n) for impl in ("normal", "drop_h") for n in (1, 2)
    ]
    assert saved["meta"]["device_name"] == "cpu" and re.fullmatch(
        r"[0-9a-f]{40}(\+dirty)?", saved["meta"]["commit"]
    )
    assert "torch" in saved["meta"]["versions"] and "timing" not in saved["meta"]  # no times here
    assert out.with_suffix(".md").read_text() == memory_stack.to_markdown(rows)
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_an_fp8_saved_stack_is_measured_beside_bf16_at_its_true_bytes(tmp_path):
    """drop_h+fp8 saves x, the 1-byte copy of the [M, 2F] preactivation and one bf16 scale per
    row per 128 columns of each half, in place of drop_h's fp32 preactivation."""
    out = tmp_path / "stack.json"
    args = [*ARGS, "--layers", "1,2", "--mlp-impl", "drop_h,drop_h+fp8", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = {(r["impl"], r["layers"]): r["saved_for_backward_bytes"] for r in json.loads(
        out.read_text())["results"]}  # fmt: skip
    m, d, f = 8, 16, 24
    x, preact, copy = m * d * 4, m * 2 * f * 4, m * 2 * f + m * 2 * 1 * 2  # one block per half
    for n in (1, 2):
        assert saved["drop_h", n] == n * (x + preact)
        assert saved["drop_h+fp8", n] == n * (x + copy)
