"""Measured tiles for the gated GEMM at small M, where the autotuner's own timing misleads.

Triton's autotuner times each candidate in one launch after flushing L2. At the 8-80 us calls
of decode and short prompts that ranks configs by noise: at Qwen-0.5B, M = 128 its pick ran
1.83x the cuBLAS fc1 GEMM where the best config ran 1.18x (benchmarks/results/
inference/sweep_gated_h200.json; the first sweep, sweep_gated_first_h200.json, saw 1.23x against
1.01x at M = 16). ``benchmarks/sweep_gated_configs.py --table`` times every config as the
inference benchmark does (CUDA graphs, weights streaming from HBM) and writes this table: per
measured (K, F), per measured M, the fastest config.

Lookup: the exact (K, F), since the best tile depends on how F splits into programs and how
many stay resident per SM, so a nearby shape says little; then the entry of the smallest
measured M at or above the call's M, none past the largest. Only the call that was measured
is pinned: canonical fc1, no aux output, no bias, a 16-bit dtype, through TMA on sm_90 (and in
the interpreter, which has no TMA, so CI runs the pinned launch). Every other call autotunes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.resources
import re
from collections.abc import Iterator, Mapping
from importlib.resources.abc import Traversable
from pathlib import Path

import torch
import triton

from swiglu_train.kernels.runtime import INTERPRET, device_capability
from swiglu_train.tables import check_header, read_json

SCHEMA = 1
PACKAGED_TABLE = "gated_tiles_h200.json"
TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_stages", "num_warps", "PERSISTENT")
PINNED_DTYPES = (torch.bfloat16, torch.float16)
_TABLE_KEYS = {"schema", "gpu", "commit", "command", "shapes"}
_READER_KEYS = {"over_gemm_only", "autotuned_over_best"}  # measurements kept for readers

Tiles = Mapping[tuple[int, int], tuple[tuple[int, dict], ...]]  # (K, F) -> ((M, tile), ...)


class GatedTilesError(ValueError):
    """A tile table off schema; the message names where and what."""


def from_dict(raw: object, source: str = "<table>") -> Tiles:
    """Validate a table: every tile a power-of-two shape the kernel can launch."""

    def fail(where: str, problem: str) -> GatedTilesError:
        return GatedTilesError(f"gated tile table {source}: {where}: {problem}")

    raw = check_header(raw, _TABLE_KEYS, set(), SCHEMA, fail)
    if not isinstance(raw["shapes"], dict):
        raise fail("shapes", "expected an object of KxF -> {M: tile}")
    tiles = {}
    for name, by_m in raw["shapes"].items():
        match = isinstance(name, str) and re.fullmatch(r"([1-9][0-9]*)x([1-9][0-9]*)", name)
        if not match or not isinstance(by_m, dict) or not by_m:
            raise fail(f"shapes.{name}", "expected KxF -> a non-empty object of M -> tile")
        entries = []
        for m, tile in by_m.items():
            if not (isinstance(m, str) and re.fullmatch(r"[1-9][0-9]*", m) and _valid_tile(tile)):
                raise fail(
                    f"shapes.{name}.{m}",
                    f"expected M >= 1 -> {{{', '.join(TILE_KEYS)}}} (blocks and warps powers "
                    "of two, BLOCK_N and BLOCK_K >= 16, stages >= 1, PERSISTENT a bool)",
                )
            entries.append((int(m), {k: tile[k] for k in TILE_KEYS}))
        tiles[int(match[1]), int(match[2])] = tuple(sorted(entries, key=lambda e: e[0]))
    return tiles


def _valid_tile(tile: object) -> bool:
    if not isinstance(tile, dict) or not set(TILE_KEYS) <= set(tile) <= {*TILE_KEYS, *_READER_KEYS}:
        return False
    blocks = [tile[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")]
    powers = all(type(v) is int and v > 0 and v & (v - 1) == 0 for v in blocks)
    stages = type(tile["num_stages"]) is int and tile["num_stages"] >= 1
    wide = tile["BLOCK_N"] >= 16 and tile["BLOCK_K"] >= 16  # K >= 16: sm_90's tl.dot minimum
    return powers and stages and wide and type(tile["PERSISTENT"]) is bool


def read_table(path: Path | Traversable) -> Tiles:
    return from_dict(read_json(path, GatedTilesError, "gated tile table"), str(path))


@functools.cache
def packaged_table() -> Tiles:
    """The table shipped in this package, read on first use."""
    return read_table(importlib.resources.files("swiglu_train.kernels").joinpath(PACKAGED_TABLE))


# Per thread (and asyncio task): a module global let two threads' overlapping use_tiles
# restore each other's table, leaving one in force after both had exited.
_override: contextvars.ContextVar[Tiles | None] = contextvars.ContextVar(
    "gated_tiles_override", default=None
)


@contextlib.contextmanager
def use_tiles(table: dict | Path) -> Iterator[Tiles]:
    """Pin from this table (its JSON form or a file) instead of the packaged one, in this
    thread: for tests, and for trying a fresh sweep before shipping it."""
    tiles = from_dict(table) if isinstance(table, dict) else read_table(Path(table))
    token = _override.set(tiles)
    try:
        yield tiles
    finally:
        _override.reset(token)


def pinned_tile(k: int, f: int, m: int) -> dict | None:
    """The measured tile for x [m, k] @ fc1 [2f, k], or None to autotune."""
    override = _override.get()
    table = override if override is not None else packaged_table()
    for measured_m, tile in table.get((k, f), ()):
        if m <= measured_m:
            return tile
    return None


def pinned_config(
    x: torch.Tensor, f: int, chunk: int, aux: str, *, has_bias: bool, use_tma: bool
) -> triton.Config | None:
    """The launch config pinned for this call, or None where the table does not apply: a bias
    or the pointer path (x unaligned for TMA) is another kernel, whose best tile was not timed."""
    measured_call = chunk == f and aux == "none" and not has_bias and x.dtype in PINNED_DTYPES
    on_sm90 = use_tma and x.is_cuda and device_capability(x.device.index or 0)[0] == 9
    where_measured = INTERPRET or on_sm90
    if not (measured_call and where_measured):
        return None
    tile = pinned_tile(x.shape[1], f, x.shape[0])
    if tile is None:
        return None
    blocks = {k: tile[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PERSISTENT")}
    return triton.Config(
        {**blocks, "GROUP_M": 8}, num_stages=tile["num_stages"], num_warps=tile["num_warps"]
    )
