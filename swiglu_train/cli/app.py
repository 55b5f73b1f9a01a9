"""The ``swiglu-train`` Typer app and what its commands share: results, progress, console."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress
from typer.core import TyperGroup

from swiglu_train.extras import explain

DEBUG_ENV = "SWIGLU_TRAIN_DEBUG"
# What the package raises for bad input (its TableError and DispatchTableError are ValueErrors),
# and what the system raises for a file that cannot be read or written (OSError: a missing
# input, a read-only directory, a full disk): shown as one line. A bug can raise these types
# too, so the line says how to see where; any other exception keeps its traceback. One that
# carries ``rank`` is raised alike by every rank of a distributed run (the same checkpoint
# refused by each): rank 0 alone prints it.
USER_ERRORS = (ValueError, OSError)
# Exit codes. 2: the input was refused, as click exits for a usage error (a bad option value);
# ours match it, so a value refused by a config check, or a file named that is missing or of the
# wrong kind, exits as a bad option does. 1: the machine or the install failed the command (a
# full disk, an I/O error, a missing extra).
INPUT_ERROR = 2
FAILURE = 1
# OSErrors about the path the user named, not the machine: refused input (OSError(errno, ...)
# is made one of these by its errno).
INPUT_OS_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def exit_code(e: Exception) -> int:
    """INPUT_ERROR for a ValueError or an OSError about a named path, FAILURE for the rest."""
    if isinstance(e, OSError) and not isinstance(e, INPUT_OS_ERRORS):
        return FAILURE
    return INPUT_ERROR


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def error_text(e: Exception) -> str:
    """The error in one line; an OSError as the system names it, path first ("out.pt: No space
    left on device"), rather than "[Errno 28] No space left on device: 'out.pt'"."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {e.strerror}"
    return str(e) or type(e).__name__


# click's base exception, reached through Typer's public BadParameter: Typer 0.29+ vendors its
# own copy of click, so the ``click`` package's class is not the one raised.
CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def print_error(message: str) -> None:
    """One ``error:`` line on stderr, never wrapped and printed as typed: a message split at the
    terminal's width reads differently at every width, and Rich would take [x] for markup."""
    error_console.print(
        f"error: {message}", markup=False, emoji=False, highlight=False, soft_wrap=True
    )


class OneLineUsageErrors(TyperGroup):
    """Typer's command group, printing a usage error (a bad option value, a missing argument) as
    one line instead of Typer's boxed panel, whose text wraps at the terminal's width."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except CLICK_EXCEPTION as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # its message is the help text
                e.show()
            else:
                ctx = getattr(e, "ctx", None)
                where = f" (see {ctx.command_path} --help)" if ctx else ""
                print_error(f"{e.format_message()}{where}")
            sys.exit(e.exit_code)
        except typer.Abort:
            print_error("aborted")
            sys.exit(FAILURE)
        # Without standalone mode click returns typer.Exit's code, or the command's return value.
        sys.exit(result if isinstance(result, int) else 0)


class App(typer.Typer):
    """A Typer app whose entry point reports input errors in one line instead of a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ImportError as e:  # an optional dependency: one line naming the extra to install
            line = explain(e)
            if line is None or debugging():
                raise
            print_error(line)
            raise SystemExit(FAILURE) from None
        except USER_ERRORS as e:
            if debugging():
                raise
            if getattr(e, "rank", 0) == 0:
                print_error(f"{error_text(e)} ({DEBUG_ENV}=1 shows the traceback)")
            raise SystemExit(exit_code(e)) from None  # every rank stops, printed or not


app = App(
    cls=OneLineUsageErrors,
    help="SwiGLU MLP layers that give pretraining its activation memory back.\n\n"
    f"Input errors print one line; set {DEBUG_ENV}=1 to see their traceback. Exit codes: "
    f"{INPUT_ERROR}, the input was refused (an option, a config value or a file named); "
    f"{FAILURE}, the machine or the install failed the command (a full disk, a missing extra).",
)
# soft_wrap: a printed line is never broken at the terminal's width (tables still fit it).
console = Console(soft_wrap=True)
error_console = Console(stderr=True, soft_wrap=True)


@app.callback()
def main() -> None:
    """swiglu-train: ParMLP impls, benchmarks and recipes."""


def parse_shape(value: str) -> tuple[int, int, int, int]:
    try:
        parts = [int(v) for v in value.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 4 or min(parts) < 1:
        raise typer.BadParameter(
            f"expected four positive integers M,D,F,O; got {value!r}", param_hint="'--shape'"
        )
    return tuple(parts)  # type: ignore[return-value]


def parse_ints(value: str, option: str, low: int = 1) -> list[int]:
    """A comma-separated list of integers >= ``low``, refused whole and named by its option: an
    empty list or a zero would otherwise run and print an empty or meaningless table."""
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < low:
        raise typer.BadParameter(
            f"expected integers >= {low}, comma-separated; got {value!r}", param_hint=option
        )
    return numbers


def check_output(path: Path | str | None, option: str, directory: bool = False) -> None:
    """Refuse an output path that cannot be written before the work that produces it.

    A directory where a file goes, or a file where a directory goes or above one, fails only
    when the output is written, after the whole run, with an OSError traceback.
    """
    if path is None:
        return
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        what = "a directory; give a file's path" if path.is_dir() else "a file, not a directory"
        raise typer.BadParameter(f"{path} is {what}", param_hint=option)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise typer.BadParameter(
                    f"{parent} is a file, so {path} cannot be written", param_hint=option
                )
            return


def require_device(device: str) -> str:
    """Check --device before a run: a CUDA run without CUDA fails deep in torch otherwise."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise typer.BadParameter(
            f"{device!r} is not a torch device", param_hint="'--device'"
        ) from e
    if kind == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter(
            "CUDA is not available on this machine; pass --device cpu for a smoke run",
            param_hint="'--device'",
        )
    return device


def invocation() -> str:
    """The command line as typed, for result files (``python -m`` shows up as its module)."""
    program = Path(sys.argv[0]).name
    if program == "__main__.py":
        program = "python -m swiglu_train"
    return " ".join([program, shlex.join(sys.argv[1:])])


@contextlib.contextmanager
def progress_bars() -> Iterator[Callable[[str, int], Callable[[], None]]]:
    """A rich progress bar factory: ``progress(label, total)`` returns the task's tick. Where
    the console is no terminal (a log, a pipe), a bar draws nothing, so each task prints a
    line as it starts and one as it ends: a run stopped midway shows where it was."""
    with Progress(console=console, transient=True) as bar:

        def progress(label: str, total: int) -> Callable[[], None]:
            task = bar.add_task(label, total=total)
            if console.is_terminal:
                return lambda: bar.advance(task)
            began, done = time.perf_counter(), 0
            console.print(f"{label}: started ({total})", markup=False)

            def tick() -> None:
                nonlocal done
                done += 1
                bar.advance(task)
                if done == total:
                    seconds = time.perf_counter() - began
                    console.print(f"{label}: done in {seconds:.1f} s", markup=False)

            return tick

        yield progress
