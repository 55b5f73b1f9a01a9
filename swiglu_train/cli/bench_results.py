"""What the bench commands share: their --json path checked before the run, and the results
printed and written after it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from rich.markdown import Markdown
from rich.markup import escape

from swiglu_train.cli.app import check_output, console
from swiglu_train.files import atomic_write, write_json_atomic, write_png_atomic


def check_results_path(json_path: Path | None, siblings: tuple[str, ...]) -> None:
    """--json and the files written beside it (its name with these suffixes) must be writable and
    distinct: ``--json r.md`` would have the table overwrite the JSON."""
    if json_path is None:
        return
    if json_path.suffix in siblings:
        raise typer.BadParameter(
            f"{json_path}: the {'/'.join(siblings)} written beside it would replace it; "
            "give a .json path",
            param_hint="'--json'",
        )
    for path in (json_path, *(json_path.with_suffix(suffix) for suffix in siblings)):
        check_output(path, "'--json'")


def write_results(
    result: dict,
    markdown: str,
    json_path: Path | None,
    md_path: Path | None,
    plot_path: Path | None,
    plot: Callable[[dict], object],
) -> None:
    """Print the tables, then write each output asked for, atomically, naming it. ``plot``
    imports matplotlib (the plot extra) only when a plot is asked for."""
    console.print(Markdown(markdown))
    if json_path is not None:
        write_json_atomic(json_path, result)
        console.print(f"wrote {escape(str(json_path))}")
    if md_path is not None:
        with atomic_write(md_path) as f:
            f.write(markdown)
        console.print(f"wrote {escape(str(md_path))}")
    if plot_path is not None:
        write_png_atomic(plot_path, plot(result), dpi=110)
        console.print(f"wrote {escape(str(plot_path))}")
