"""Fit the cost model ``impl="auto"`` reads (``layers/auto_model.py``) from measured rows.

The input is a ``bench-grid`` or ``bench-crossover`` result (``meta`` + ``rows``), from CUDA:
the fit needs each row's GPU and host time per step, the floor's step, and the allocator's
after-forward reading. Every term is fitted over all points, not looked up at one, because
impls differ by about 1 %, the noise of a single point:

- ``floor_tflops``: the median of the floor's 18·M·D·F / step over the points where every impl
  is GPU-bound. There the floor's step is its GEMMs' GPU time: it queues the same six GEMMs
  with less host work than any impl (no activation kernels, no autograd Functions), so its
  host time is further below its GPU time than theirs. Elsewhere (D = 896 at small M on the
  H200) the floor may be timing the host, and a GEMM rate read there would be wrong.
- per impl, ``c + a/D``: least squares of gpu_ms / the floor's estimate over the impl's
  GPU-bound points (its host time there is hidden behind the GPU, so gpu_ms is its step).
- per impl, ``host_ms``: the median over all its points (host work barely depends on shape).
- per impl, after-forward bytes ``per_md·M·D + per_mf·M·F``: least squares without an
  intercept (saved tensors are [M, D] or [M, F] shaped), rounded to 0.01 byte per element,
  below which the allocator's rounding decides.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from swiglu_train.layers.auto_model import GEMM_FLOPS_PER_MDF, MIB, SCHEMA, AutoModel
from swiglu_train.layers.registry import MLP_IMPLS

Dims = tuple[int, int, int]
_READINGS = ("gpu_ms", "host_ms", "floor_ms", "after_forward_MiB")


def fit_auto_model(result: dict, command: str) -> dict:
    """The model file's dict, validated, from a result's rows of our impls (peers ignored);
    ``command`` is what wrote it. A result without CUDA readings raises ValueError."""
    meta = result["meta"]
    if meta.get("gpu_family") is None:
        raise ValueError(
            "an auto model needs CUDA readings (GPU and host time per step, allocator "
            "memory); this result was measured off CUDA"
        )
    if not meta.get("command"):
        raise ValueError("the result records no command that measured it, for the model to cite")
    rows = [r for r in result["rows"] if _impl(r) in MLP_IMPLS]
    if not rows:
        raise ValueError(f"no rows of our impls ({', '.join(MLP_IMPLS)}) to fit a model from")
    for r in rows:
        for key in _READINGS:
            value = r.get(key)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"row M={r['M']} D={r['D']} F={r['F']} {_impl(r)}: {key} is {value!r}; "
                    f"an auto model needs every row's {', '.join(_READINGS)} from a CUDA run "
                    "that timed GPU and host apart"
                )
    floor_tflops = _floor_tflops(rows)
    impls = {}
    for name in MLP_IMPLS:
        mine = [r for r in rows if _impl(r) == name]
        if mine:
            impls[name] = _fit_impl(name, mine, floor_tflops)
    model = {
        "schema": SCHEMA,
        "gpu_family": meta["gpu_family"],
        "device_name": meta["device_name"],
        "commit": meta["commit"],
        "dtype": meta["dtype"],
        "measured_with": meta["command"],
        "command": command,
        "floor_tflops": floor_tflops,
        "points": [list(p) for p in sorted({_dims(r) for r in rows})],
        "impls": impls,
    }
    AutoModel.from_dict(model, "fitted from the result")
    return model


def _impl(row: dict) -> str:
    """The impl a row measured: grid rows name it ``variant``, crossover rows ``impl``."""
    return row["variant"] if "variant" in row else row["impl"]


def _dims(row: dict) -> Dims:
    return row["M"], row["D"], row["F"]


def _floor_tflops(rows: Sequence[dict]) -> float:
    by_point: dict[Dims, list[dict]] = {}
    for r in rows:
        by_point.setdefault(_dims(r), []).append(r)
    rates = [
        GEMM_FLOPS_PER_MDF * m * d * f / (point[0]["floor_ms"] * 1e9)
        for (m, d, f), point in by_point.items()
        if all(r["gpu_ms"] > r["host_ms"] for r in point)
    ]
    if not rates:
        raise ValueError(
            "no point where every impl is GPU-bound (gpu_ms > host_ms): the floor's GEMM rate "
            "cannot be read from host-bound steps; measure larger shapes"
        )
    return _significant(statistics.median(rates))


def _fit_impl(name: str, rows: Sequence[dict], floor_tflops: float) -> dict:
    gpu_bound = [r for r in rows if r["gpu_ms"] > r["host_ms"]]
    if len({r["D"] for r in gpu_bound}) < 2:
        raise ValueError(
            f"{name}: GPU-bound points (gpu_ms > host_ms) at {len(gpu_bound)} points and "
            f"{len({r['D'] for r in gpu_bound})} D; c + a/D needs two D or more"
        )
    floor = np.array([GEMM_FLOPS_PER_MDF * m * d * f for m, d, f in map(_dims, gpu_bound)])
    y = np.array([r["gpu_ms"] for r in gpu_bound]) / (floor / (floor_tflops * 1e9))
    x = np.array([[1.0, 1.0 / r["D"]] for r in gpu_bound])
    (c, a), *_ = np.linalg.lstsq(x, y, rcond=None)
    shapes = np.array([[r["M"] * r["D"], r["M"] * r["F"]] for r in rows], dtype=float)
    saved = np.array([r["after_forward_MiB"] * MIB for r in rows])
    (per_md, per_mf), *_ = np.linalg.lstsq(shapes, saved, rcond=None)
    return {
        "c": _significant(c),
        "a": _significant(a),
        "host_ms": _significant(statistics.median(r["host_ms"] for r in rows)),
        "after_forward_per_md": round(float(per_md), 2),
        "after_forward_per_mf": round(float(per_mf), 2),
        "gpu_points": len(gpu_bound),
    }


def _significant(value: float, digits: int = 6) -> float:
    """Rounded to ``digits`` significant digits: the file stays readable, and a refit of the
    same rows writes the same numbers."""
    return float(f"{float(value):.{digits}g}")
