"""Measure quack (on its static and its dynamic tile schedule) against cuBLAS on each
layout-free GEMM of the quack impls at a model's shapes, and cache the fastest
(``ops.gemm_choice``) for training runs to read.

Each GEMM is timed on the operands, strides and dtype the impls give it, the libraries in a
random order per sample (paired), each sample a batch of back-to-back calls between two CUDA
events, queued behind a spin kernel, so that launch latency is not counted. Against the
default library (``gemm_choice.default``), another is chosen only where its median paired
ratio is below ``1 - MARGIN`` (the lowest such ratio wins); within the margin the GEMM keeps
its default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from swiglu_train.bench.timing import Clock
from swiglu_train.ops import gemm_choice
from swiglu_train.ops.quack_mlp import gemm_on

MARGIN = 0.01  # within 1 % the measurement cannot tell the two apart: keep the default
BATCH = 5
LIBRARIES = gemm_choice.LIBRARIES


@dataclass(frozen=True)
class Measured:
    gemm: str
    m: int
    n: int
    k: int
    quack_ms: float
    quack_dynamic_ms: float | None  # None where that library failed to run (``failed``)
    cublas_ms: float
    cublas_over_quack: float  # median paired ratios, each sample's own
    quack_dynamic_over_quack: float | None
    backend: str
    failed: dict[str, str]  # library -> its error: left out of the choice


def operands(gemm: str, m: int, n: int, k: int, dtype: torch.dtype) -> tuple:
    """a [m, k] and b [k, n] with the strides the impls pass: a transposed view where the impl
    passes one (grad_yᵀ, grad_preactᵀ, W2ᵀ)."""
    device = "cuda"
    if gemm in ("grad_w2", "grad_w1_packed", "grad_w1_concat"):  # a = (an [k, m] activation)ᵀ
        a = torch.randn(k, m, device=device, dtype=dtype).t()
    else:
        a = torch.randn(m, k, device=device, dtype=dtype)
    if gemm == "fc2":  # b = W2ᵀ, W2 stored [n, k]
        b = torch.randn(n, k, device=device, dtype=dtype).t()
    else:
        b = torch.randn(k, n, device=device, dtype=dtype)
    return a, b


def calls(gemm: str, a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The ways the impls compute ``gemm`` (``quack_mlp.gemm_on``), by library."""
    return {lib: functools.partial(gemm_on, lib, gemm, a, b) for lib in LIBRARIES}


def paired_ratio(times: dict[str, np.ndarray], library: str, base: str) -> float:
    """Median over samples of ``library``'s time over ``base``'s in the same sample."""
    return float(np.median(times[library] / times[base]))


def decide(times: dict[str, np.ndarray], default: str) -> str:
    """The library to cache: the one furthest under the default's time past MARGIN (paired),
    else ``default``, so a measured tie caches what an unmeasured shape would run anyway."""
    ratios = {lib: paired_ratio(times, lib, default) for lib in times if lib != default}
    best = min(ratios, key=ratios.get)
    return best if ratios[best] < 1 - MARGIN else default


def _warm(calls: dict[str, Callable[[], object]], keep: str) -> dict[str, str]:
    """Compile (quack) and warm up each call; a library that fails is dropped from ``calls``
    and its error returned, unless it is ``keep`` (the default, what training runs anyway)."""
    failed = {}
    for name, call in list(calls.items()):
        try:
            for _ in range(3):
                call()
        except Exception as e:
            if name == keep:
                raise
            failed[name] = f"{type(e).__name__}: {e}".splitlines()[0]
            del calls[name]
    return failed


def _time_paired(calls: dict[str, Callable[[], object]], samples: int, seed: int) -> dict:
    """Per library, ``samples`` times (ms per call), each batch queued behind a spin kernel as a
    training step's GEMMs are, so neither launch latency nor an idle GPU's start counts."""
    clock = Clock(torch.device("cuda"))
    rng = np.random.default_rng(seed)
    names = list(calls)
    times = {name: np.zeros(samples) for name in names}
    for s in range(samples):
        for i in rng.permutation(len(names)):
            clock.hold()
            start = clock.mark()
            for _ in range(BATCH):
                calls[names[i]]()
            end = clock.mark()
            clock.sync()
            times[names[i]][s] = clock.ms(start, end) / BATCH
    return times


def planned(
    shapes: Iterable[tuple[int, int, int, int]], impls: Iterable[str]
) -> list[tuple[str, int, int, int]]:
    """(gemm, m, n, k) for every GEMM the ``impls`` run at each (M, D, F, O), each once."""
    gemms = {g for impl in impls for g in gemm_choice.IMPL_GEMMS[impl]}
    return sorted({(g, *gemm_choice.gemm_sizes(g, *shape)) for shape in shapes for g in gemms})


def _measure(
    gemm: str, m: int, n: int, k: int, dtype: torch.dtype, samples: int, seed: int
) -> Measured:
    a, b = operands(gemm, m, n, k, dtype)
    default = gemm_choice.default(gemm, m, n, gemm_choice.sm_count(a.get_device()))
    ways = calls(gemm, a, b)
    failed = _warm(ways, keep=default)
    times = _time_paired(ways, samples, seed)
    ms = {lib: float(np.median(t)) for lib, t in times.items()}
    dynamic = gemm_choice.QUACK_DYNAMIC in times
    return Measured(
        gemm, m, n, k, ms[gemm_choice.QUACK], ms.get(gemm_choice.QUACK_DYNAMIC),
        ms[gemm_choice.CUBLAS], paired_ratio(times, gemm_choice.CUBLAS, gemm_choice.QUACK),
        paired_ratio(times, gemm_choice.QUACK_DYNAMIC, gemm_choice.QUACK) if dynamic else None,
        decide(times, default), failed,
    )  # fmt: skip


def pretune(
    shapes: Iterable[tuple[int, int, int, int]],
    impls: Iterable[str],
    dtype: torch.dtype,
    samples: int = 30,
    tick: Callable[[], None] = lambda: None,
) -> list[Measured]:
    """Time and cache every GEMM the ``impls`` run at each (M, D, F, O); a GEMM two impls
    share is timed once."""
    sizes = planned(shapes, impls)
    device_name = torch.cuda.get_device_name()
    measured, entries = [], {}
    for seed, (gemm, m, n, k) in enumerate(sizes):
        row = _measure(gemm, m, n, k, dtype, samples, seed)
        measured.append(row)
        fields = asdict(row)
        entries[gemm_choice.key(gemm, m, n, k, dtype, device_name)] = {
            name: fields[name] for name in fields if name not in ("gemm", "m", "n", "k")
        }
        tick()
    gemm_choice.record(entries)
    return measured
