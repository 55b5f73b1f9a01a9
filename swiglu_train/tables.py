"""The JSON tables measured on a GPU and shipped in the package (auto's cost model, the
inference dispatch table): the file reading and header checks they share, so both name the
file and the spot of any problem the same way."""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib.resources.abc import Traversable
from pathlib import Path

Fail = Callable[[str, str], ValueError]  # (where, problem) -> the table's own error


def read_json(path: Path | Traversable, error: type[ValueError], kind: str) -> object:
    """The parsed file; invalid JSON raises ``error`` naming the file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{kind} {path}: not valid JSON ({e})") from None


def check_header(
    raw: object, required: set[str], optional: set[str], schema: int, fail: Fail
) -> dict:
    """The table as a dict with exactly the required keys (and any optional ones) and this
    schema version; anything else raises through ``fail``."""
    if not isinstance(raw, dict):
        raise fail("top level", f"expected an object, got {type(raw).__name__}")
    missing, unknown = required - set(raw), set(raw) - required - optional
    if missing or unknown:
        raise fail("top level", f"missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    if type(raw["schema"]) is not int or raw["schema"] != schema:  # true == 1 in Python
        raise fail("schema", f"expected {schema}, got {raw['schema']!r}")
    return raw
