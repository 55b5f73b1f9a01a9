"""The gated GEMM's autotuning candidates: the tile list measured on the H200, fitted to each
call's layout and dtype and pruned to the tiles sized for its M, and the pre-hook that gives
the TMA descriptors each config's box. At small M the measured kind of call skips the
autotuner and launches the tile gated_tiles' rule picks instead.
"""

from __future__ import annotations

import triton

from swiglu_train.kernels.runtime import INTERPRET


def autotune_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2,
                               "PERSISTENT": False})]  # fmt: skip
    # Measured on the H200 (benchmarks/tune_gated_gemm.py): at training shapes the 8-warp
    # [128, 2·128] tile with 3-4 stages wins, and a persistent grid loses 15-25 % (no epilogue
    # overlap without warp specialization; Triton 3.6's Hopper autoWS takes only 4-warp,
    # two-dot tiles here, runs 2x slower and miscompiles: probe_ws_h200.json); for decode
    # and short prompts small-M tiles with deep K, where a persistent grid evens out the waves.
    # At M <= 512 the GEMM streams W1 from HBM, so narrow-N tiles (many programs, more loads in
    # flight) are candidates too: with 128-wide tiles, 0.5B's F = 4864 fills 38 of 132 SMs at
    # M = 128 and 7B's 148 tiles run in two waves, the second one 16 tiles long. Few stages
    # (or warps) let several programs share an SM, so at 7B's M <= 16 all 592 of 16x32 run
    # in one wave (sweep_gated_h200.json: 0.92x cuBLAS). At small M the autotuner's timing
    # misranks these (see gated_tiles), so there a rule on the SM count picks the tile.
    tiles = [  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, persistent)
        (128, 128, 64, 3, 8, False),
        (128, 128, 64, 4, 8, False),
        (256, 64, 64, 3, 8, False),
        (128, 64, 64, 4, 8, False),
        (128, 64, 64, 4, 8, True),
        (128, 32, 128, 3, 4, False),
        (64, 128, 64, 4, 4, False),
        (64, 64, 128, 4, 4, False),
        (64, 64, 64, 4, 4, False),
        (64, 32, 64, 4, 4, False),
        (64, 32, 128, 4, 4, False),
        (32, 64, 128, 4, 4, False),
        (16, 64, 128, 4, 4, False),
        (16, 64, 128, 4, 4, True),
        (16, 32, 128, 4, 4, False),
        (16, 32, 128, 4, 2, False),
        (16, 32, 128, 2, 4, False),
        (16, 64, 128, 2, 4, False),
        (16, 128, 128, 3, 4, False),
    ]
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PERSISTENT": p},
            num_stages=s,
            num_warps=w,
            pre_hook=set_block_shapes,
        )
        for bm, bn, bk, s, w, p in tiles
    ]


def set_block_shapes(nargs: dict) -> None:
    """TMA descriptors carry their box shape, which depends on the config being tried."""
    if nargs["USE_TMA"]:
        bm, bn = nargs["BLOCK_M"], nargs["BLOCK_N"]
        nargs["x"].block_shape = [bm, nargs["BLOCK_K"]]
        wide = nargs["CHUNK"] == bn  # the kernel's single-dot path loads gate and up together
        nargs["w"].block_shape = [2 * bn if wide else bn, nargs["BLOCK_K"]]
        for out in ("h_out", "aux_out", "aux_up_out"):
            nargs[out].block_shape = [bm, bn]


SHARED_MEMORY_BYTES = 232448  # per SM on the H100/H200 (sm_90)


def fit_config(
    config: triton.Config, chunk: int, canonical: bool, element_size: int
) -> triton.Config:
    """The config, narrowed where it does not fit this layout or dtype.

    A packed tile must not straddle a gate/up boundary, so BLOCK_N shrinks to the chunk when
    the chunk is narrower; and BLOCK_K halves until the pipelined x and W1 tiles fit in shared
    memory (the list is sized for 16-bit operands; fp32 needs half the K depth per stage).
    """
    kw = dict(config.kwargs)
    if not canonical and chunk < kw["BLOCK_N"]:
        kw["BLOCK_N"] = chunk
    per_k = (kw["BLOCK_M"] + 2 * kw["BLOCK_N"]) * element_size * config.num_stages
    while per_k * kw["BLOCK_K"] > SHARED_MEMORY_BYTES and kw["BLOCK_K"] > 16:
        kw["BLOCK_K"] //= 2
    if kw == config.kwargs:
        return config
    return triton.Config(
        kw, num_stages=config.num_stages, num_warps=config.num_warps, pre_hook=config.pre_hook
    )


def prune_configs(
    configs: list[triton.Config], named_args: dict, **constexprs
) -> list[triton.Config]:
    """Fit every config to the layout and dtype, then keep the tiles sized for this M."""
    chunk = constexprs["CHUNK"]
    canonical = chunk == named_args["F"]
    element_size = named_args["b_ptr"].element_size()
    fitted = {}
    for c in configs:
        c = fit_config(c, chunk, canonical, element_size)
        fitted.setdefault((tuple(sorted(c.kwargs.items())), c.num_stages, c.num_warps), c)
    configs = list(fitted.values())
    m_cap = max(named_args["M_BUCKET"], 16)
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= m_cap] or [
        min(configs, key=lambda c: c.kwargs["BLOCK_M"])
    ]
    if m_cap < 128:  # tiles much shorter than M only multiply the W1 traffic
        kept = [c for c in kept if c.kwargs["BLOCK_M"] * 2 >= m_cap] or kept
    return kept
