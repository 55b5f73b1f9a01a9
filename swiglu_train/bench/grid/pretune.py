"""Which GEMM libraries the model grid's quack impls run on: the defaults, or, with
``--pretune``, what ``swiglu-train pretune`` measures at each point just before it is timed.

Either way the grid reads a cache of its own, never the user's: a point must not depend on
what someone pretuned on the machine before. Pretuned, each point records every GEMM's timings
and the library chosen (``pretuned`` in its JSON), so the same run says both what pretuning
buys over the defaults and what the defaults should be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Sequence

import torch

from swiglu_train.bench.grid.prewarm import warm_point
from swiglu_train.bench.mlp.run import BenchConfig
from swiglu_train.bench.pretune import measure as pretune
from swiglu_train.bench.prewarm import Warmed
from swiglu_train.bench.results import DTYPES
from swiglu_train.ops import gemm_choice
from swiglu_train.ops.quack_mlp import quack_unavailable_reason

DEFAULTS = "defaults (ops.gemm_choice), no cache"
PRETUNED = "pretuned at each point (swiglu-train pretune), in the grid's own cache"


def pretuned_impls(variants: Sequence[str]) -> list[str]:
    """The variants whose GEMM libraries pretune chooses."""
    return [v for v in variants if v in gemm_choice.IMPL_GEMMS]


@contextlib.contextmanager
def private_cache() -> Iterator[None]:
    """Point the GEMM-choice cache at an empty folder for the run (inherited by spawned
    pre-warm workers), then back."""
    before = os.environ.get("SWIGLU_TRAIN_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="swiglu-grid-cache-") as folder:
        os.environ["SWIGLU_TRAIN_CACHE_DIR"] = folder
        gemm_choice.forget()
        try:
            yield
        finally:
            if before is None:
                del os.environ["SWIGLU_TRAIN_CACHE_DIR"]
            else:
                os.environ["SWIGLU_TRAIN_CACHE_DIR"] = before
            gemm_choice.forget()


def why_not(variants: Sequence[str], device: str) -> str | None:
    """Why pretuning cannot run for this grid, or None when it can."""
    if not pretuned_impls(variants):
        return f"none of the variants chooses GEMM libraries ({sorted(gemm_choice.IMPL_GEMMS)})"
    if device != "cuda":
        return "pretune times GEMMs on CUDA only"
    return quack_unavailable_reason()


def pretune_point(dims: tuple[int, int, int], variants: Sequence[str], dtype) -> list[dict]:
    """Time and cache the libraries of the quack impls' GEMMs at (M, D, F), O = D."""
    m, d, f = dims
    rows = pretune.pretune([(m, d, f, d)], pretuned_impls(variants), dtype)
    return [dataclasses.asdict(r) for r in rows]


def warm_point_and_gemms(cfg: BenchConfig) -> Warmed:
    """A pre-warm worker's task with ``--pretune``: the point's variants, then one call of each
    library on each GEMM pretune will time there (quack compiles each schedule once per
    shape), so the timing pass's pretune finds them compiled."""
    outcome = warm_point(cfg)
    m, d, f, o = cfg.shape
    dtype = DTYPES[cfg.dtype]
    for gemm, gm, gn, gk in pretune.planned([(m, d, f, o)], pretuned_impls(cfg.variants)):
        a, b = pretune.operands(gemm, gm, gn, gk, dtype)
        for library, call in pretune.calls(gemm, a, b).items():
            try:
                call()
            except Exception as e:  # the timing pass meets it again, and reports it
                outcome.not_warmed[f"{gemm} on {library}"] = f"{type(e).__name__}: {e}"
        del a, b
    torch.cuda.empty_cache()
    return outcome
