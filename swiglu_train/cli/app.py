"""The ``swiglu-train`` Typer app and what its commands share: results, progress, console."""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import Progress

app = typer.Typer(help="SwiGLU MLP layers that give pretraining its activation memory back.")
console = Console()


@app.callback()
def main() -> None:
    """swiglu-train: ParMLP impls, benchmarks and recipes."""


def parse_shape(value: str) -> tuple[int, int, int, int]:
    parts = [int(v) for v in value.split(",")]
    if len(parts) != 4 or min(parts) < 1:
        raise typer.BadParameter("expected four positive integers M,D,F,O")
    return tuple(parts)  # type: ignore[return-value]


def invocation() -> str:
    """The command line as typed, for result files (``python -m`` shows up as its module)."""
    program = Path(sys.argv[0]).name
    if program == "__main__.py":
        program = "python -m swiglu_train"
    return " ".join([program, shlex.join(sys.argv[1:])])


@contextlib.contextmanager
def progress_bars() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """A rich progress bar factory: ``progress(label, total)`` returns the task's tick."""
    with Progress(console=console, transient=True) as bar:

        def progress(label: str, total: int) -> Callable[[], None]:
            task = bar.add_task(label, total=total)
            return lambda: bar.advance(task)

        yield progress
