"""What the end-to-end harnesses share (benchmarks/bench_e2e.py; the Lightning one in
``lightning``, the Megatron one in ``megatron``): their rounds, a figure's spread over rounds,
one row per configuration, adding rounds to an earlier run, and writing the outputs."""

from __future__ import annotations

import json
import random
import socket
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from swiglu_train.files import atomic_write, write_json_atomic, write_png_atomic

# The figures of a point that a row spreads over rounds (optimizer_s: absent in older runs).
FIGURES = ("tokens_per_s", "optimizer_s", "after_forward_MiB", "peak_MiB")


def parse_list(value: str, cast=str) -> list:
    return [cast(v) for v in value.split(",") if v.strip()]


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def machine_id() -> str:
    """The GPU's UUID (the host's name on the CPU): rounds added by a later call may run on
    another machine of the same model, whose clocks differ by a few percent, so every point
    names the one it ran on and a comparison of medians can tell when it spans two."""
    if not torch.cuda.is_available():
        return f"cpu:{socket.gethostname()}"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)  # absent from some builds (fbcode's)
    return f"GPU-{uuid}" if uuid is not None else f"{props.name} on {socket.gethostname()}"


def machines(*rows: dict) -> list[str]:
    """The machines behind ``rows`` (their points'), in order; older points name none."""
    return list(dict.fromkeys(m for r in rows for m in r.get("machines", ())))


def spread(values: list[float | None]) -> dict | None:
    """min/median/max of the measured values; None when none was measured (out of memory)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def rows(points: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One row per configuration (the ``keys`` of its points), its figures' spreads."""
    out = {}
    for p in points:
        out.setdefault(tuple(p[k] for k in keys), []).append(p)
    return [
        {k: v for k, v in zip(keys, key, strict=True)}
        | {
            "rounds": len(mine),
            "out_of_memory": sum(p["peak_MiB"] is None for p in mine),
            "machines": list(dict.fromkeys(p["machine"] for p in mine if p.get("machine"))),
            **{f: spread([p.get(f) for p in mine]) for f in FIGURES},
        }
        for key, mine in out.items()
    ]


def prior_points(json_path: Path | None, settings: dict) -> list[dict]:
    """The points of an earlier run in ``json_path`` with these settings, to add rounds to."""
    if json_path is None or not json_path.is_file():
        return []
    earlier = json.loads(json_path.read_text())
    differ = {k: (earlier.get(k), v) for k, v in settings.items() if earlier.get(k) != v}
    if differ:
        raise ValueError(f"--append: {json_path} was made with other settings: {differ}")
    return earlier["points"]


def point_writer(json_path: Path | None, settings: dict) -> Callable[[list[dict]], None]:
    """Writes the settings and the points so far to ``json_path`` after each point (what
    ``--append`` reads), so a call stopped at its time bound keeps what it measured and the
    next call adds rounds to it; the finished run writes its whole result over it."""

    def write(points: list[dict]) -> None:
        if json_path is not None:
            write_json_atomic(json_path, settings | {"points": points, "partial": True})

    return write


def next_rounds(points: list[dict], rounds: int, seed: int) -> tuple[range, random.Random]:
    """The ``rounds`` rounds numbered on from ``points``' last, and the visiting order's
    generator, seeded by the first of them so an added call does not repeat an earlier order."""
    first = 1 + max((p["round"] for p in points), default=-1)
    return range(first, first + rounds), random.Random(seed + first)


def write_result(
    result: dict,
    json_path: Path | None,
    md: Path | None,
    plot: Path | None,
    markdown: Callable[[dict], str],
    draw: Callable[[dict], object] | None,
) -> None:
    """Print the markdown, then write each output asked for, atomically."""
    if json_path is not None:
        write_json_atomic(json_path, result)
    text = markdown(result)
    print(text)
    if md is not None:
        with atomic_write(md) as f:
            f.write(text)
    if plot is not None and draw is not None:
        write_png_atomic(plot, draw(result), dpi=120)
