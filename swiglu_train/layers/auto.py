"""``impl="auto"``: pick a concrete impl from the crossover table measured on this GPU family.

Why once, at construction, and not per forward: ``save_factors`` reads fc1 packed while
``normal`` and ``drop_h`` read it canonical, so the choice fixes the parameter layout, and an
optimizer's per-element state (Adam moments) is laid out like the parameters it was created
with. Switching per forward, as the token count varies, would repack fc1 under a live
optimizer. So ParMLP resolves ``auto`` once, from a tokens-per-micro-batch hint, before any
optimizer holds its parameters.

The rule, at the table point nearest in log-space to (tokens_hint, D, F): take the fastest
impl (by the paired median ratio to the six-GEMM floor), and among impls within
``TIE_TOLERANCE`` of it the one with the least after-forward memory. Impls this machine cannot
run (the quack impls without quack, below sm_90, or with D, F or the output size not a multiple
of 8) are left out first.

The fallback is ``drop_h``: it is never slower than ``normal`` by more than noise and saves
M·F·2 bytes per layer (h is recomputed instead of saved), while ``save_factors`` is a layout
change whose pay-off has to be measured. It applies with no tokens_hint, off CUDA, with no
table for this GPU family, and when the nearest point is more than one grid step away in any
dimension (a measurement that far off says little about this shape).
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable

import torch

from swiglu_train.layers.registry import MLP_IMPLS, QUACK_IMPLS
from swiglu_train.ops.quack_mlp import ALIGN, quack_available
from swiglu_train.tables import check_header, read_json

FALLBACK = "drop_h"
TIE_TOLERANCE = 0.01  # impls within 1 % of the fastest count as equally fast
SCHEMA = 1
DIMS = ("M", "D", "F")
SINGLE_VALUE_STEP = 1.0  # log2 grid step of a dimension the table measured at one value only
_TABLE_KEYS = {"schema", "gpu_family", "device_name", "commit", "dtype", "points"}
_OPTIONAL_TABLE_KEYS = {"source", "command"}
_STAT_KEYS = ("ms", "ratio_to_floor", "after_forward_MiB")


class TableError(ValueError):
    """A crossover table that does not follow the schema; the message names where and what."""


@dataclass(frozen=True)
class ImplStats:
    """One impl at one point: median step ms, paired median ratio to the floor, after-fwd MiB."""

    ms: float
    ratio_to_floor: float
    after_forward_MiB: float


@dataclass(frozen=True)
class TablePoint:
    M: int
    D: int
    F: int
    impls: Mapping[str, ImplStats]

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.M, self.D, self.F


@dataclass(frozen=True)
class CrossoverTable:
    """The measured points of one GPU family, as shipped in ``crossover_<family>.json``."""

    gpu_family: str
    device_name: str
    commit: str
    dtype: str
    points: tuple[TablePoint, ...]

    @classmethod
    def from_dict(cls, raw: object, source: str = "<table>") -> CrossoverTable:
        """Validate and read a table; anything off schema raises TableError naming the spot."""

        def fail(where: str, problem: str) -> TableError:
            return TableError(f"crossover table {source}: {where}: {problem}")

        raw = check_header(raw, _TABLE_KEYS, _OPTIONAL_TABLE_KEYS, SCHEMA, fail)
        for key in ("gpu_family", "device_name", "commit", "dtype"):
            if not isinstance(raw[key], str) or not raw[key]:
                raise fail(key, f"expected a non-empty string, got {raw[key]!r}")
        if not isinstance(raw["points"], list) or not raw["points"]:
            raise fail("points", "expected a non-empty list")
        points = [_point(p, f"points[{i}]", fail) for i, p in enumerate(raw["points"])]
        dims = [p.dims for p in points]
        if len(set(dims)) != len(dims):
            raise fail("points", "the same (M, D, F) appears twice")
        return cls(
            raw["gpu_family"], raw["device_name"], raw["commit"], raw["dtype"], tuple(points)
        )

    def grid_steps(self) -> tuple[float, float, float]:
        """Per dimension, the widest log2 gap between adjacent measured values."""
        steps = []
        for axis in range(len(DIMS)):
            values = sorted({math.log2(p.dims[axis]) for p in self.points})
            gaps = [b - a for a, b in itertools.pairwise(values)]
            steps.append(max(gaps, default=SINGLE_VALUE_STEP))
        return steps[0], steps[1], steps[2]


def _point(raw: object, where: str, fail) -> TablePoint:
    if not isinstance(raw, dict) or set(raw) != {*DIMS, "impls"}:
        raise fail(where, "expected an object with exactly the keys M, D, F, impls")
    for dim in DIMS:
        value = raw[dim]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fail(f"{where}.{dim}", f"expected a positive integer, got {value!r}")
    impls = raw["impls"]
    if not isinstance(impls, dict) or not impls:
        raise fail(f"{where}.impls", "expected a non-empty object of impl -> stats")
    stats = {}
    for name in MLP_IMPLS:  # registry order, so ties resolve the same way everywhere
        if name in impls:
            stats[name] = _stats(impls[name], f"{where}.impls.{name}", fail)
    unknown = sorted(set(impls) - set(stats))
    if unknown:
        raise fail(f"{where}.impls", f"unknown impls {unknown}; valid: {', '.join(MLP_IMPLS)}")
    return TablePoint(raw["M"], raw["D"], raw["F"], stats)


def _stats(raw: object, where: str, fail) -> ImplStats:
    if not isinstance(raw, dict) or set(raw) != set(_STAT_KEYS):
        raise fail(where, f"expected an object with exactly the keys {', '.join(_STAT_KEYS)}")
    for key in _STAT_KEYS:
        value, zero_ok = raw[key], key == "after_forward_MiB"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise fail(f"{where}.{key}", f"expected a finite number {bound}, got {value!r}")
    return ImplStats(*(float(raw[k]) for k in _STAT_KEYS))


def choose(impls: Mapping[str, ImplStats]) -> tuple[str, str]:
    """The rule at one point: (impl, why). Fastest by ratio to floor (paired, so it cancels
    clock drift that unpaired ms medians keep); within TIE_TOLERANCE, least memory wins."""
    fastest = min(impls, key=lambda n: impls[n].ratio_to_floor)
    best = impls[fastest].ratio_to_floor
    close = [n for n in impls if impls[n].ratio_to_floor <= best * (1 + TIE_TOLERANCE)]
    pick = min(close, key=lambda n: impls[n].after_forward_MiB)
    s = impls[pick]
    if pick == fastest:
        return pick, f"fastest ({s.ratio_to_floor:.3f}x floor)"
    return pick, (
        f"{s.ratio_to_floor:.3f}x floor, within {TIE_TOLERANCE:.0%} of {fastest} "
        f"({best:.3f}x) with less after-forward memory "
        f"({s.after_forward_MiB:.0f} vs {impls[fastest].after_forward_MiB:.0f} MiB)"
    )


@dataclass(frozen=True)
class Resolution:
    impl: str
    reason: str


def resolve(
    tokens_hint: int | None,
    hidden_size: int,
    ffn_hidden_size: int,
    device_name: str | None,
    table: CrossoverTable | None,
    *,
    output_size: int | None = None,
    quack: bool | None = None,
) -> Resolution:
    """The concrete impl for ``auto`` (see the module docstring for the rule and fallback).

    ``device_name`` is None off CUDA; ``table`` is the table found for that device, or None
    (a table of another GPU family counts as none). ``output_size`` (fc2's, default D) is not
    a table dimension, but quack's kernels need it aligned like D and F. ``quack`` says
    whether quack runs on that device (None: ask this machine); the model-grid benchmark
    judges auto's choices for the GPU it measured from a CPU machine.
    """
    integral = isinstance(tokens_hint, numbers.Integral) and not isinstance(tokens_hint, bool)
    if tokens_hint is not None and (not integral or tokens_hint < 1):
        raise ValueError(f"tokens_hint must be a positive token count, got {tokens_hint!r}")

    def fallback(why: str) -> Resolution:
        return Resolution(FALLBACK, f"fallback to {FALLBACK}: {why}")

    if device_name is None:
        return fallback("not on a CUDA device, and the crossover tables are measured on GPUs")
    family = gpu_family(device_name)
    if table is None or gpu_family(table.gpu_family) != family:
        return fallback(f"no crossover table for GPU family {family!r} ({device_name})")
    if tokens_hint is None:
        return fallback("no tokens_hint (tokens per micro-batch) to look the table up with")
    query = (tokens_hint, hidden_size, ffn_hidden_size)
    point = min(table.points, key=lambda p: _log_distance(p.dims, query))
    where = f"M={point.M}, D={point.D}, F={point.F}"
    for dim, q, p, step in zip(DIMS, query, point.dims, table.grid_steps(), strict=True):
        if abs(math.log2(q / p)) > step + 1e-9:
            return fallback(
                f"{dim}={q} is more than one grid step (x{2**step:.2f}) from the nearest "
                f"measured point ({where}) on {table.device_name}"
            )
    sizes = (hidden_size, ffn_hidden_size, hidden_size if output_size is None else output_size)
    quack_runs = quack_available() if quack is None else quack
    quack_fits = all(n % ALIGN == 0 for n in sizes) and quack_runs
    runnable = {n: v for n, v in point.impls.items() if n not in QUACK_IMPLS or quack_fits}
    if not runnable:
        return fallback(f"none of the impls measured at {where} can run here (quack cannot)")
    impl, why = choose(runnable)
    return Resolution(
        impl,
        f"{impl}: {why} at the nearest measured point ({where}) on "
        f"{table.device_name} in {table.dtype}, commit {table.commit}",
    )


def _log_distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return math.dist([math.log2(v) for v in a], [math.log2(v) for v in b])


def gpu_family(device_name: str) -> str:
    """ "NVIDIA H200" -> "H200", "NVIDIA A100-SXM4-80GB" -> "A100": the first model token."""
    tokens = re.split(r"[\s\-_]+", device_name.upper())
    return next((t for t in tokens if t != "NVIDIA" and any(c.isdigit() for c in t)), tokens[0])


def table_filename(family: str) -> str:
    return f"crossover_{re.sub(r'[^a-z0-9]', '', family.lower())}.json"


def read_table(path: Traversable) -> CrossoverTable:
    """A crossover table file, validated; bad JSON or schema raises TableError naming it."""
    raw = read_json(path, TableError, "crossover table")
    return CrossoverTable.from_dict(raw, str(path))


@functools.cache
def packaged_table(family: str) -> CrossoverTable | None:
    """The table shipped for a GPU family in this package, or None when there is none."""
    resource = importlib.resources.files("swiglu_train.layers").joinpath(table_filename(family))
    return read_table(resource) if resource.is_file() else None


def target_device_name(device: torch.device | str | None) -> str | None:
    """The CUDA device a new ParMLP will run on, or None when it runs elsewhere.

    An explicit ``device`` decides; with none (or ``meta``) the module is taken to be built
    before being moved, as Lightning and most training loops do, so the current CUDA device
    counts when there is one.
    """
    if device is not None and torch.device(device).type not in ("cuda", "meta"):
        return None
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def resolve_auto(
    tokens_hint: int | None,
    hidden_size: int,
    ffn_hidden_size: int,
    device: torch.device | str | None,
    *,
    output_size: int | None = None,
) -> Resolution:
    """``resolve`` with this machine's device and this package's table for its family."""
    name = target_device_name(device)
    table = packaged_table(gpu_family(name)) if name is not None else None
    return resolve(tokens_hint, hidden_size, ffn_hidden_size, name, table, output_size=output_size)
