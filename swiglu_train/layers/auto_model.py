"""The cost model ``impl="auto"`` reads: its file format, validation, and per-impl predictions.

One file per GPU family (``auto_<family>.json``), fitted by ``swiglu_train.layers.auto_fit``
from a measured grid. Its terms, all in units a reader can check against the grid:

- ``floor_tflops``: the six-GEMM floor's throughput, 18·M·D·F FLOPs over its step time, so the
  floor's estimate at any shape is ``18·M·D·F / floor_tflops``;
- per impl, its GPU time over that estimate, ``c + a/D``: c is its GEMMs' efficiency against
  cuBLAS's (quack's GEMMs differ), a/D the share of its activation passes, which move O(M·F)
  bytes against the GEMMs' O(M·D·F) FLOPs and so fall as 1/D;
- per impl, ``host_ms``: the host's time to queue one step (Python, autograd, launches). A step
  costs max(GPU, host), as the benchmark's timer charges it (``bench/timing.py``), so a small
  shape is host-bound and the impl with the least host work wins it;
- per impl, after-forward bytes ``per_md·M·D + per_mf·M·F`` (exact up to the allocator's
  rounding), which only breaks ties.

The 1/D term says little far from the D it was fitted at, so a model serves only D within a
factor of two of its fitted range (``d_range``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from swiglu_train.layers.registry import MLP_IMPLS
from swiglu_train.tables import Fail, check_header, read_json

SCHEMA = 1
GEMM_FLOPS_PER_MDF = 18  # six GEMMs of 2·M·(2F)·D, 2·M·F·D (fwd) and twice that (bwd)
D_REACH = 2.0  # a model serves D in [min fitted D / D_REACH, max fitted D * D_REACH]
MIB = 2**20
_MODEL_KEYS = {
    *("schema", "gpu_family", "device_name", "commit", "dtype", "measured_with", "command"),
    *("floor_tflops", "points", "impls"),
}
_IMPL_KEYS = ("c", "a", "host_ms", "after_forward_per_md", "after_forward_per_mf", "gpu_points")


class TableError(ValueError):
    """An auto model file that does not follow the schema; the message names where and what."""


@dataclass(frozen=True)
class Prediction:
    """One impl at one shape: predicted step over the floor, its parts, after-forward bytes."""

    ratio: float
    gpu_ms: float
    host_ms: float
    after_forward_bytes: float

    @property
    def host_bound(self) -> bool:
        return self.host_ms > self.gpu_ms


@dataclass(frozen=True)
class ImplModel:
    """One impl's fitted terms (see the module docstring); ``gpu_points``: how many GPU-bound
    points its ``c + a/D`` was fitted from."""

    c: float
    a: float
    host_ms: float
    after_forward_per_md: float
    after_forward_per_mf: float
    gpu_points: int

    def predict(self, m: int, d: int, f: int, floor_ms: float) -> Prediction:
        gpu_ms = (self.c + self.a / d) * floor_ms
        memory = self.after_forward_per_md * m * d + self.after_forward_per_mf * m * f
        return Prediction(max(gpu_ms, self.host_ms) / floor_ms, gpu_ms, self.host_ms, memory)


@dataclass(frozen=True)
class AutoModel:
    """One GPU family's fitted model, as shipped in ``auto_<family>.json``."""

    gpu_family: str
    device_name: str
    commit: str  # the commit the grid was measured at
    dtype: str
    measured_with: str  # the command that measured the grid
    command: str  # the command that fitted this file from it
    floor_tflops: float
    points: tuple[tuple[int, int, int], ...]  # (M, D, F) fitted from
    impls: Mapping[str, ImplModel]  # registry order

    @property
    def d_range(self) -> tuple[float, float]:
        """The D this model serves: its fitted D's, widened by ``D_REACH`` either way."""
        ds = [d for _, d, _ in self.points]
        return min(ds) / D_REACH, max(ds) * D_REACH

    def floor_ms(self, m: int, d: int, f: int) -> float:
        return GEMM_FLOPS_PER_MDF * m * d * f / (self.floor_tflops * 1e9)

    def predict(self, m: int, d: int, f: int) -> dict[str, Prediction]:
        """Every impl's prediction at (M, D, F), in registry order."""
        floor_ms = self.floor_ms(m, d, f)
        return {name: impl.predict(m, d, f, floor_ms) for name, impl in self.impls.items()}

    @classmethod
    def from_dict(cls, raw: object, source: str = "<model>") -> AutoModel:
        """Validate and read a model; anything off schema raises TableError naming the spot."""

        def fail(where: str, problem: str) -> TableError:
            return TableError(f"auto model {source}: {where}: {problem}")

        raw = check_header(raw, _MODEL_KEYS, set(), SCHEMA, fail)
        for key in ("gpu_family", "device_name", "commit", "dtype", "measured_with", "command"):
            if not isinstance(raw[key], str) or not raw[key]:
                raise fail(key, f"expected a non-empty string, got {raw[key]!r}")
        floor_tflops = _number(raw["floor_tflops"], "floor_tflops", fail, positive=True)
        points = _points(raw["points"], fail)
        impls = raw["impls"]
        if not isinstance(impls, dict) or not impls:
            raise fail("impls", "expected a non-empty object of impl -> fitted terms")
        unknown = sorted(set(impls) - set(MLP_IMPLS))
        if unknown:
            raise fail("impls", f"unknown impls {unknown}; valid: {', '.join(MLP_IMPLS)}")
        fitted = {n: _impl(impls[n], f"impls.{n}", fail) for n in MLP_IMPLS if n in impls}
        model = cls(
            raw["gpu_family"], raw["device_name"], raw["commit"], raw["dtype"],
            raw["measured_with"], raw["command"], floor_tflops, points, fitted,
        )  # fmt: skip
        for name, impl in fitted.items():  # c + a/D is monotone in D: its ends suffice
            for d in model.d_range:
                if impl.c + impl.a / d <= 0:
                    raise fail(
                        f"impls.{name}",
                        f"c + a/D = {impl.c!r} + {impl.a!r}/{d:g} is not positive at the edge "
                        "of the model's D range: a GPU time cannot be",
                    )
        return model


def _number(value: object, where: str, fail: Fail, positive: bool = False) -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or (positive and value <= 0):
        bound = "finite number > 0" if positive else "finite number"
        raise fail(where, f"expected a {bound}, got {value!r}")
    return float(value)


def _points(raw: object, fail: Fail) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(raw, list) or not raw:
        raise fail("points", "expected a non-empty list of [M, D, F]")
    points = []
    for i, point in enumerate(raw):
        valid = isinstance(point, list) and len(point) == 3
        if not valid or not all(type(v) is int and v > 0 for v in point):
            raise fail(f"points[{i}]", f"expected [M, D, F] of positive integers, got {point!r}")
        points.append((point[0], point[1], point[2]))
    if len(set(points)) != len(points):
        raise fail("points", "the same [M, D, F] appears twice")
    return tuple(points)


def _impl(raw: object, where: str, fail: Fail) -> ImplModel:
    if not isinstance(raw, dict) or set(raw) != set(_IMPL_KEYS):
        raise fail(where, f"expected an object with exactly the keys {', '.join(_IMPL_KEYS)}")
    c, a = _number(raw["c"], f"{where}.c", fail), _number(raw["a"], f"{where}.a", fail)
    host_ms = _number(raw["host_ms"], f"{where}.host_ms", fail, positive=True)
    memory = []
    for key in ("after_forward_per_md", "after_forward_per_mf"):
        value = _number(raw[key], f"{where}.{key}", fail)
        if value < 0:
            raise fail(f"{where}.{key}", f"expected bytes per element >= 0, got {value!r}")
        memory.append(value)
    count = raw["gpu_points"]
    if type(count) is not int or count < 2:
        raise fail(f"{where}.gpu_points", f"expected an integer >= 2, got {count!r}")
    return ImplModel(c, a, host_ms, memory[0], memory[1], count)


def read_model(path: Path | Traversable) -> AutoModel:
    """A model file, validated; bad JSON or schema raises TableError naming it."""
    raw = read_json(path, TableError, "auto model")
    return AutoModel.from_dict(raw, str(path))
