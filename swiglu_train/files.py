"""Atomic file output: results, reports, checkpoints and CSVs are never left half-written."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


class _WriteErrors:
    """The temporary file, remembering the first OSError a write raised: torch.save turns one
    (a full disk, a quota) into a RuntimeError ('unexpected pos') that has lost the cause."""

    def __init__(self, file: IO) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """A file beside ``path`` that replaces it only once written whole.

    A crash or an exception inside the block leaves the old file (or none) and no temporary.
    An OSError that names no file, or the temporary, is raised again naming ``path``, so that
    the CLI's one-line report says which output failed; so is a write's OSError that the code
    inside the block (torch.save) turned into another exception.
    """
    path = Path(path)
    prefix = f".{path.name}."
    tmp, file = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
        with os.fdopen(fd, mode, **open_kwargs) as f:
            file = _WriteErrors(f)
            yield file  # type: ignore[misc]
        os.chmod(tmp, 0o644)  # mkstemp files are private; results and reports are for sharing
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        cause = e if isinstance(e, OSError) else None
        if cause is None and isinstance(e, Exception) and file is not None:
            cause = file.error
        name = None if cause is None else cause.filename
        if cause is not None and (name is None or os.path.basename(str(name)).startswith(prefix)):
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from e
        raise


def png_bytes(figure: Any, dpi: int) -> bytes:
    """A matplotlib figure as a 256-colour palette PNG: a third of its RGBA bytes, with no
    visible change to line and bar plots. Result plots are committed under ``benchmarks/``,
    and every device call carries the tracked tree beside the wheels in 64 MiB."""
    from PIL import Image  # pillow comes with matplotlib, the only caller's dependency

    rendered, out = io.BytesIO(), io.BytesIO()
    figure.savefig(rendered, format="png", dpi=dpi)
    rendered.seek(0)
    Image.open(rendered).convert("RGB").quantize(256).save(out, format="png", optimize=True)
    return out.getvalue()


def write_png_atomic(path: Path, figure: Any, dpi: int) -> None:
    """``png_bytes`` of the figure, rendered whole before ``path`` is touched."""
    data = png_bytes(figure, dpi)
    with atomic_write(path, "wb") as f:
        f.write(data)


def json_bytes(payload: dict) -> bytes:
    """JSON with one value per line and no indentation, and a trailing newline: a quarter
    fewer bytes than indent=2 and still diffable. Results are committed, and every device call
    carries the tracked tree in 64 MiB."""
    return (json.dumps(payload, indent=0, separators=(",", ":")) + "\n").encode()


def write_json_atomic(path: Path, payload: dict) -> None:
    """``json_bytes`` of the payload, written atomically."""
    data = json_bytes(payload)
    with atomic_write(path, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """A directory beside ``path`` to write into, renamed to ``path`` only once written whole.

    ``path`` must not exist or be an empty directory: one holding files is never merged into
    or replaced. A crash or an exception inside the block leaves ``path`` as it was and no
    temporary.
    """
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise ValueError(f"{path} exists and is not an empty directory; not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp directories are private; outputs are for sharing
        os.replace(tmp, path)  # POSIX rename replaces an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
