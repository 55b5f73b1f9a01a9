"""Atomic file output: results, reports, checkpoints and CSVs are never left half-written."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: Path, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """A file beside ``path`` that replaces it only once written whole.

    A crash or an exception inside the block leaves the old file (or none) and no temporary.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
        os.chmod(tmp, 0o644)  # mkstemp files are private; results and reports are for sharing
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, payload: dict) -> None:
    """Indented JSON with a trailing newline, written atomically."""
    with atomic_write(path) as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
