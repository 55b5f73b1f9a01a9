"""Which no-grad path serves a shape: the table that ``swiglu-train bench-inference`` measured.

The table (``inference_dispatch_h200.json``, written by ``bench-inference --dispatch-table``)
holds, per measured shape "DxF", two kinds of entry, each mapping a measured M to the path that
was fastest there (with its ms and the runner-up's margin, for readers):
  "gated"  h alone (fc1 + SwiGLU): "gated" (our Triton gated GEMM), "cublas" (cuBLAS fc1,
           then our activation kernel) or "quack" (quack's GEMM with the SwiGLU epilogue);
  "mlp"    the whole MLP: "fused_mlp", or one of those three followed by cuBLAS fc2.
A "quack" entry also names its "fallback", the path the fit picks without quack, which serves where
quack cannot (not installed, below sm_90, fp32, sizes not multiples of 8, fc1 not row-major).

Lookup for (D, F, M): the nearest measured shape by Euclidean distance in (log2 D, log2 F), ties
to the smaller D·F. D and F count separately, not as their product, because they are different
GEMM axes (fc1's K and N): 896x4864 and 4864x896 hold the same weights but tile differently.
Within that shape, the measured M nearest in log2 space, ties to the smaller M; an M below or
above every measured one takes the nearest end. There is no distance limit: the nearest
measurement says more about a shape than the constants below do. The H200's table serves every
device, as the constants it replaces did, until another GPU family is measured.

Fallback: with no entry of the kind asked (the shipped file until the H200 run fills it), the
rules measured before the table: fused_mlp up to DEFAULT_FUSED_MLP_MAX_M rows, the gated GEMM up
to DEFAULT_GATED_MAX_M (tie with cuBLAS at Qwen-7B, benchmarks/results/gemm/tune_gated_h200.json),
cuBLAS + the activation kernel beyond.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

import torch

from swiglu_train.tables import check_header, read_json

SCHEMA = 1
PACKAGED_TABLE = "inference_dispatch_h200.json"
QUACK = "quack"
WITHOUT_QUACK = {"gated": ("gated", "cublas"), "mlp": ("fused_mlp", "gated", "cublas")}
PATHS = {kind: (*paths, QUACK) for kind, paths in WITHOUT_QUACK.items()}
DEFAULT_FUSED_MLP_MAX_M = 16
DEFAULT_GATED_MAX_M = 4096
_TABLE_KEYS = {"schema", "gpu", "commit", "dtype", "shapes"}
_OPTIONAL_TABLE_KEYS = {"source", "command", "note"}

Choices = tuple[tuple[int, str, str], ...]  # (M, path, path without quack) by increasing M


class DispatchTableError(ValueError):
    """A dispatch table off schema; the message names where and what."""


@dataclass(frozen=True)
class DispatchTable:
    """Per measured (D, F), per kind ("gated", "mlp"), the fastest path at each measured M."""

    shapes: Mapping[tuple[int, int], Mapping[str, Choices]]

    @classmethod
    def from_dict(cls, raw: object, source: str = "<table>") -> DispatchTable:
        """Validate and read a table; anything that would misroute a call raises."""

        def fail(where: str, problem: str) -> DispatchTableError:
            return DispatchTableError(f"dispatch table {source}: {where}: {problem}")

        raw = check_header(raw, _TABLE_KEYS, _OPTIONAL_TABLE_KEYS, SCHEMA, fail)
        if not isinstance(raw["shapes"], dict):
            raise fail("shapes", "expected an object of DxF -> entries")
        shapes = {}
        for name, kinds in raw["shapes"].items():
            # [0-9], not \d: int() reads digits of any script, so "8x1\u0666" would be 8x16 again
            match = re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", name)
            if not match or not isinstance(kinds, dict) or not set(kinds) <= set(PATHS):
                raise fail(f"shapes.{name}", f"expected DxF -> an object with keys in {PATHS}")
            shapes[int(match[1]), int(match[2])] = {
                kind: _choices(kind, by_m, f"shapes.{name}.{kind}", fail)
                for kind, by_m in kinds.items()
            }
        return cls(shapes)


def _choices(kind: str, by_m: object, where: str, fail) -> Choices:
    if not isinstance(by_m, dict) or not by_m:
        raise fail(where, "expected a non-empty object of M -> {path, ...}")
    choices = []
    for m, entry in by_m.items():
        path = entry.get("path") if isinstance(entry, dict) else None
        # one spelling per M: "016" (or a non-ASCII digit) would give 16 a second entry
        spelled = isinstance(m, str) and re.fullmatch(r"[1-9][0-9]*", m)
        if not spelled or path not in PATHS[kind]:
            raise fail(f"{where}.{m}", f"expected M >= 1 -> {{path: one of {PATHS[kind]}}}")
        fallback = entry.get("fallback", path)
        if (path == QUACK) != ("fallback" in entry) or fallback not in WITHOUT_QUACK[kind]:
            raise fail(
                f"{where}.{m}",
                "a 'quack' path needs a 'fallback' among "
                f"{WITHOUT_QUACK[kind]}, and only a 'quack' path has one",
            )
        choices.append((int(m), path, fallback))
    return tuple(sorted(choices))


def read_table(path: Path | Traversable) -> DispatchTable:
    """A table file, validated; bad JSON or schema raises DispatchTableError naming it."""
    raw = read_json(path, DispatchTableError, "dispatch table")
    return DispatchTable.from_dict(raw, str(path))


@functools.cache
def packaged_table() -> DispatchTable:
    """The table shipped in this package, read on first use."""
    return read_table(importlib.resources.files("swiglu_train.ops").joinpath(PACKAGED_TABLE))


_override: DispatchTable | None = None


@contextlib.contextmanager
def use_table(table: DispatchTable | dict | Path) -> Iterator[DispatchTable]:
    """Dispatch from this table (an object, its JSON form, or a file) instead of the packaged
    one, for tests and for trying a freshly measured table before shipping it. A graph that
    torch.compile traced keeps the paths of the table it was traced with."""
    global _override
    if isinstance(table, dict):
        table = DispatchTable.from_dict(table)
    elif not isinstance(table, DispatchTable):
        table = read_table(Path(table))
    previous, _override = _override, table
    try:
        yield table
    finally:
        _override = previous


def active_table() -> DispatchTable:
    """The table lookups read now: the one ``use_table`` set, else the packaged one."""
    return _override if _override is not None else packaged_table()


def choose(
    kind: str, hidden_size: int, ffn_size: int, m: int, quack: Callable[[], bool] = lambda: False
) -> str:
    """The path for ``kind`` ("gated" or "mlp") at (D, F, M): the table's, else the default.
    ``quack`` says whether quack's kernel can serve this call, asked only when the table names
    quack; where it cannot, the entry's fallback."""
    choices = _nearest_shape(kind, hidden_size, ffn_size)
    if choices is None:
        return default_path(kind, m)
    entry = choices[-1]
    for lo, hi in itertools.pairwise(choices):
        if m * m <= lo[0] * hi[0]:  # log m <= the mean of log lo and log hi: lo is nearer
            entry = lo
            break
    return entry[1] if entry[1] != QUACK or quack() else entry[2]


def default_path(kind: str, m: int) -> str:
    """The rules that apply where the table has no entry of this kind."""
    if kind == "mlp" and m <= DEFAULT_FUSED_MLP_MAX_M:
        return "fused_mlp"
    return "gated" if m <= DEFAULT_GATED_MAX_M else "cublas"


@torch.compiler.assume_constant_result
def _nearest_shape(kind: str, hidden_size: int, ffn_size: int) -> Choices | None:
    """The nearest measured shape's choices for ``kind``, or None when no shape has any.

    A constant to torch.compile (D and F are weight dimensions, static in a graph), so the
    table file is read outside any graph; M stays symbolic in :func:`choose`'s integer test.
    """
    shapes = active_table().shapes.items()
    measured = [(shape, kinds[kind]) for shape, kinds in shapes if kind in kinds]
    if not measured:
        return None

    def distance(item: tuple[tuple[int, int], Choices]) -> tuple[float, int]:
        (d, f), _ = item
        return math.hypot(math.log2(hidden_size / d), math.log2(ffn_size / f)), d * f

    return min(measured, key=distance)[1]
