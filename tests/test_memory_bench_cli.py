"""bench-memory writes its table and plot atomically, like its JSON."""

from pathlib import Path

from typer.testing import CliRunner

from swiglu_train.bench import memory_stack
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


def test_a_failed_plot_leaves_the_previous_png_whole(tmp_path, monkeypatch):
    out = tmp_path / "stack.json"
    previous = b"\x89PNG previous run"
    out.with_suffix(".png").write_bytes(previous)
    monkeypatch.setattr(memory_stack, "plot", lambda rows: _FailingFigure())
    args = ["bench-memory", "--device", "cpu", "--dtype", "fp32", "--shape", "8,16,24,16"]
    result = CliRunner().invoke(app, [*args, "--layers", "1", "--json", str(out)])
    assert isinstance(result.exception, OSError)
    assert out.with_suffix(".png").read_bytes() == previous
    assert "| drop_h | 1 |" in out.with_suffix(".md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stack.json", "stack.md", "stack.png"]
