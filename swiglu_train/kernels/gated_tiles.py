"""The gated GEMM's tile at small M, from a rule on the SM count and the shape, because the
autotuner's own timing misleads there.

Triton's autotuner times each candidate in one launch after flushing L2. At the 8-80 us calls
of decode and short prompts that ranks configs by noise: at Qwen-0.5B, M = 128 its pick ran
1.56x the best config (benchmarks/results/inference/sweep_gated_h200.json; the first sweep,
sweep_gated_first_h200.json, saw 1.22x at M = 16). So up to RULE_MAX_M rows the measured kind
of call launches the tile TileRule picks from what differs between GPUs and shapes: the SM
count (read from the device at call time), shared memory per SM, M and F (wave fill, programs
resident per SM) and K (BLOCK_K no deeper than K). Judged leave one shape out on the H200
sweep (benchmarks/fit_gated_tile_rule.py, gated_tile_rule_h200.json), its pick ran 1.004x the
best config (median of 12 points, worst 1.036x), where the autotuner's ran up to 1.56x; a
table of each measured shape's fastest config beat it by at most 3.6 %, inside the 5.7 % two
runs of the sweep disagree by, so no table is kept.

Only the call that was measured is pinned: canonical fc1, no aux output, no bias, a 16-bit
dtype, through TMA on sm_90 (and in the interpreter, which has no TMA, so CI runs the pinned
launch). Every other call, and every M past RULE_MAX_M, autotunes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton

from swiglu_train.kernels.runtime import INTERPRET, device_capability

PINNED_DTYPES = (torch.bfloat16, torch.float16)

SM_SHARED_BYTES = 233472  # per SM on sm_90 (228 KiB); each resident block reserves 1 KiB more
BLOCK_RESERVE_BYTES = 1024
MAX_WARPS_PER_SM = 64
STREAM_MAX_M = 16  # up to here one 16-row block: the call streams W1 once
RULE_MAX_M = 128  # the largest M the rule was judged at (sweep_gated_h200.json)
INTERPRET_SMS = 132  # the interpreter has no SMs; the H100's and H200's count


def resident(tile: dict, element_size: int) -> int:
    """Programs of this tile one SM holds at once: its pipelined x and W1 tiles in shared
    memory (gate and up side by side), and its warps."""
    stage = (tile["BLOCK_M"] + 2 * tile["BLOCK_N"]) * tile["BLOCK_K"] * element_size
    by_smem = SM_SHARED_BYTES // (tile["num_stages"] * stage + BLOCK_RESERVE_BYTES)
    return max(1, min(by_smem, MAX_WARPS_PER_SM // tile["num_warps"]))


def wave_fill(tile: dict, m: int, f: int, sms: int, element_size: int) -> float:
    """The busy share of the SM slots over the waves the grid takes (1.0: the last wave full)."""
    programs = math.ceil(m / tile["BLOCK_M"]) * math.ceil(f / tile["BLOCK_N"])
    slots = sms * resident(tile, element_size)
    return programs / (math.ceil(programs / slots) * slots)


@dataclass(frozen=True)
class TileRule:
    """The gated GEMM's tile at M <= RULE_MAX_M from the SM count and the shape.

    Up to STREAM_MAX_M rows the call streams W1 from HBM once; what matters is how many bytes
    are in flight, so the tile is a narrow 16 x ``stream_n`` x 128 of 2 warps (many programs),
    at the deepest pipeline, up to ``stream_stages``, that still keeps every program resident
    in one wave (a second wave leaves the SMs that finish first idle); past that, 2 stages,
    the most programs per SM. Above it the tile does MMA work: 64 or 128 rows (a warpgroup
    per 64), K 64, 4 stages or 3 where that lets two programs share an SM (the second hides
    the first's epilogue). The largest such tile whose wave fill reaches ``min_fill`` wins
    (fewer W1 re-reads, bigger MMAs); where none does, the best-filled one.
    """

    min_fill: float = 0.65
    stream_n: int = 32
    stream_stages: int = 4

    def tile(self, m: int, k: int, f: int, sms: int, element_size: int = 2) -> dict | None:
        """The tile for x [m, k] @ fc1 [2f, k] on ``sms`` SMs, or None past RULE_MAX_M."""
        if not 1 <= m <= RULE_MAX_M:
            return None
        k_fit = max(16, 1 << (k - 1).bit_length())  # no deeper than K: the rest is padding
        if m <= STREAM_MAX_M:
            programs = math.ceil(f / self.stream_n)
            for stages in range(self.stream_stages, 1, -1):
                tile = _tile(16, self.stream_n, min(128, k_fit), stages, 2)
                if stages == 2 or programs <= sms * resident(tile, element_size):
                    return tile
        candidates = []
        for bm in (64, 128):
            if bm > 64 and bm > 1 << (m - 1).bit_length():
                continue  # rows past M only cost MMA work
            for bn in (32, 64, 128):
                deep = _tile(bm, bn, min(64, k_fit), 4, bm // 16)
                shallow = deep | {"num_stages": 3}
                pair = resident(deep, element_size) < 2 <= resident(shallow, element_size)
                candidates.append(shallow if pair else deep)

        def size(t: dict) -> tuple[int, int]:
            return t["BLOCK_M"] * t["BLOCK_N"], t["BLOCK_M"]

        fill = {id(t): wave_fill(t, m, f, sms, element_size) for t in candidates}
        filled = [t for t in candidates if fill[id(t)] >= self.min_fill]
        if filled:
            return max(filled, key=size)
        return max(candidates, key=lambda t: (fill[id(t)], *size(t)))


def _tile(bm: int, bn: int, bk: int, stages: int, warps: int) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PERSISTENT": False,
            "num_stages": stages, "num_warps": warps}  # fmt: skip


RULE = TileRule()

# Per thread (and asyncio task), so one thread's sweep does not unpin another's calls.
_autotune_only: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "gated_autotune_only", default=False
)


@contextlib.contextmanager
def autotune_only() -> Iterator[None]:
    """Launch every config through the autotuner in this thread: for sweeps that time the
    configs themselves, and for tests."""
    token = _autotune_only.set(True)
    try:
        yield
    finally:
        _autotune_only.reset(token)


@functools.cache
def num_sms(device_index: int) -> int:
    """The GPU's SM count, asked once per device (torch's query costs host time)."""
    if INTERPRET:
        return INTERPRET_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def rule_tile(m: int, k: int, f: int, sms: int, element_size: int = 2) -> dict | None:
    """The shipped rule's tile for x [m, k] @ fc1 [2f, k] on ``sms`` SMs (cached per shape)."""
    return RULE.tile(m, k, f, sms, element_size)


def pinned_config(
    x: torch.Tensor, f: int, chunk: int, aux: str, *, has_bias: bool, use_tma: bool
) -> triton.Config | None:
    """The launch config pinned for this call, or None to autotune: a bias or the pointer path
    (x unaligned for TMA) is another kernel, whose tiles were not timed."""
    measured_call = chunk == f and aux == "none" and not has_bias and x.dtype in PINNED_DTYPES
    on_sm90 = use_tma and x.is_cuda and device_capability(x.device.index or 0)[0] == 9
    where_measured = INTERPRET or on_sm90
    if not (measured_call and where_measured) or _autotune_only.get():
        return None
    sms = num_sms(x.device.index or 0 if x.is_cuda else 0)
    tile = rule_tile(x.shape[0], x.shape[1], f, sms, x.element_size())
    if tile is None:
        return None
    blocks = {k: tile[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PERSISTENT")}
    return triton.Config(
        {**blocks, "GROUP_M": 8}, num_stages=tile["num_stages"], num_warps=tile["num_warps"]
    )
