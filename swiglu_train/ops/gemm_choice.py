"""Which library runs each layout-free GEMM of the quack impls, as measured on this GPU.

fc2 and grad_W2 (both quack impls), and grad_x and grad_W1 of ``save_factors_quack`` (whose
fc1 is packed like its grad_preact), are plain products that quack and cuBLAS compute alike.
Neither library wins everywhere: untuned quack against cuBLAS measured 0.94-1.15x per GEMM
over four H200 training shapes (benchmarks/results/probe_quack_gemms_h200.json), with no rule
in the shapes that sorts them. So the choice is measured per shape, by
``swiglu-train pretune`` before a run (``bench/pretune.py``), and cached on disk keyed by GPU,
torch and quack versions, dtype and the GEMM's [m, k] @ [k, n] sizes. A shape the cache does
not hold keeps the default below: a training step never stalls to time anything.

The plain defaults are each GEMM's better library over those four shapes: cuBLAS for fc2 (quack
0.95-1.13x of it, slower at 3 of 4) and for grad_x and grad_W1 of the packed layout (1.04-1.15x
and 1.03-1.45x at 3 of 4); quack for grad_W2 (0.94-0.99x at 3 of 4). The whole steps agree:
in the H200 model grid's step profiles, ``save_factors_quack``'s three quack GEMMs (fc2, grad_W2,
grad_x) took 4-11 % longer than cuBLAS's same products in the floor
(probe_step_gap_host_h200.json at [4096, 4096, 11008], probe_step_gap_h200.json at
[8192, 4096, 14336]).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import warnings
from pathlib import Path

import torch

from swiglu_train.files import write_json_atomic

QUACK, CUBLAS = "quack", "cublas"
# Without a measurement: the library that won at most measured shapes (see above).
DEFAULTS = {
    "fc2": CUBLAS,
    "grad_w2": QUACK,
    "grad_x_packed": CUBLAS,
    "grad_w1_packed": CUBLAS,
    # drop_h_quack's grad_x and grad_W1: quack pairs the interleaved grad_preact with the
    # canonical fc1 inside one GEMM (concat_layout); cuBLAS needs a chunked copy or scatter per
    # step (``ops.concat_gemm``). Unmeasured at the step level: quack until pretune says so.
    "grad_x_concat": QUACK,
    "grad_w1_concat": QUACK,
}
SCHEMA = 1
# The GEMMs each impl runs on a library chosen here.
IMPL_GEMMS = {
    "drop_h_quack": ("fc2", "grad_w2", "grad_x_concat", "grad_w1_concat"),
    "save_factors_quack": ("fc2", "grad_w2", "grad_x_packed", "grad_w1_packed"),
}


def gemm_sizes(gemm: str, tokens: int, hidden: int, ffn: int, out: int) -> tuple[int, int, int]:
    """(m, n, k) of the product [m, k] @ [k, n] that ``gemm`` is in a layer of these sizes."""
    return {
        "fc2": (tokens, out, ffn),  # h @ W2ᵀ
        "grad_w2": (out, ffn, tokens),  # grad_yᵀ @ h
        "grad_x_packed": (tokens, hidden, 2 * ffn),  # grad_preact @ W1
        "grad_x_concat": (tokens, hidden, 2 * ffn),  # grad_preact (interleaved) @ W1 (canonical)
        "grad_w1_concat": (2 * ffn, hidden, tokens),  # grad_preact (interleaved)ᵀ @ x
        "grad_w1_packed": (2 * ffn, hidden, tokens),  # grad_preactᵀ @ x
    }[gemm]


def cache_path() -> Path:
    """$SWIGLU_TRAIN_CACHE_DIR, else $XDG_CACHE_HOME/swiglu-train, else ~/.cache/swiglu-train."""
    root = os.environ.get("SWIGLU_TRAIN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "swiglu-train")
    return Path(root) / "gemm_choices.json"


def key(gemm: str, m: int, n: int, k: int, dtype: torch.dtype, device_name: str) -> str:
    """One GEMM on one GPU and software stack: a new torch or quack measures again."""
    if gemm not in DEFAULTS:
        raise ValueError(f"unknown GEMM {gemm!r}; choose one of {sorted(DEFAULTS)}")
    versions = f"torch {torch.__version__}, quack {_quack_version()}"
    return f"{device_name} | {versions} | {dtype} | {gemm} | {m}x{k} @ {k}x{n}"


@functools.cache
def _quack_version() -> str:
    try:
        return importlib.metadata.version("quack-kernels")
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def _choices(path: Path) -> dict[str, str]:
    """The cached choices (read once per process); a damaged cache warns and counts as empty,
    since a cache must never stop a run."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"schema {raw.get('schema')!r}, expected {SCHEMA}")
        entries = raw["choices"]
        if not all(e.get("backend") in (QUACK, CUBLAS) for e in entries.values()):
            raise ValueError("a backend other than quack or cublas")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        warnings.warn(
            f"{path}: unreadable GEMM cache ({e}); using the defaults. Delete it and run "
            "`swiglu-train pretune` again.",
            stacklevel=3,
        )
        return {}
    return {k: e["backend"] for k, e in entries.items()}


def choice(gemm: str, m: int, n: int, k: int, dtype: torch.dtype, device_name: str) -> str:
    """The library cached for this GEMM on this GPU, else the default."""
    return _choices(cache_path()).get(key(gemm, m, n, k, dtype, device_name), DEFAULTS[gemm])


def backend(gemm: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The library for ``a @ b`` as ``gemm`` on a's CUDA device (the default under
    torch.compile, which traces one graph for every shape)."""
    if torch.compiler.is_compiling():
        return DEFAULTS[gemm]
    # get_device(), not device.index: the same index, without building a device object
    return _lookup(gemm, a.shape[0], b.shape[1], a.shape[1], a.dtype, a.get_device())


@functools.lru_cache(maxsize=1024)
def _lookup(gemm: str, m: int, n: int, k: int, dtype: torch.dtype, device: int) -> str:
    """``choice`` memoized per call signature: it runs on every step's GEMMs, where building
    the key and asking for the device's name each time would add host time."""
    return choice(gemm, m, n, k, dtype, torch.cuda.get_device_name(device))


def untimed(
    impl: str,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device_name: str,
) -> list[str]:
    """The GEMMs ``impl`` runs at (M, D, F, O) whose library no pretune chose on this GPU and
    software: they run on their default (``[]`` for an impl with no such GEMMs)."""
    choices = _choices(cache_path())
    return [
        g
        for g in IMPL_GEMMS.get(impl, ())
        if key(g, *gemm_sizes(g, *shape), dtype, device_name) not in choices
    ]


def forget() -> None:
    """Read the cache file again on the next lookup (after it was written, or moved)."""
    _choices.cache_clear()
    _lookup.cache_clear()


def record(entries: dict[str, dict]) -> Path:
    """Merge measured entries (key -> {"backend", "quack_ms", "cublas_ms"}) into the cache,
    written atomically, and make this process read the new file."""
    path = cache_path()
    current = {}
    if path.is_file():
        try:
            current = json.loads(path.read_text()).get("choices", {})
        except (OSError, ValueError, AttributeError):
            current = {}  # a damaged cache is replaced, not merged
    write_json_atomic(path, {"schema": SCHEMA, "choices": current | entries})
    forget()
    return path
