"""Which library runs each layout-free GEMM of the quack impls, as measured on this GPU.

fc2 and grad_W2 (both quack impls), and grad_x and grad_W1 of ``save_factors_quack`` (whose
fc1 is packed like its grad_preact), are plain products that quack and cuBLAS compute alike.
Neither library wins everywhere, so the choice can be measured per shape, by
``swiglu-train pretune`` before a run (``bench/pretune/measure.py``), and cached on disk keyed
by GPU, torch and quack versions, dtype and the GEMM's [m, k] @ [k, n] sizes. A shape the cache
does not hold takes the default below: a training step never stalls to time anything.

The defaults come from two probes of the model grid (12 public (D, F)). The first timed each
library from an idle GPU over 36 shapes (M 4096, 8000, 16384;
benchmarks/results/gemm/probe_gemm_defaults_h200.json): cuBLAS for fc2 (won 20, lost 8) and the
packed grad_x (23 to 2); quack for the packed grad_W1 (18 to 8) and both concat GEMMs (14 to
12; 34 to 2, where cuBLAS pays a copy). The second (``bench-grid --pretune``, every GEMM
queued behind a spin kernel as in a training step, M = 8000;
benchmarks/results/grid/grid_pretune_m8000_h200.json) added quack's dynamic schedule: it ran
grad_W1 (both layouts) and the concat grad_x in 0.945-0.994x the static schedule's time at
every shape with D >= 1536 (1.007-1.012x at the host-bound D = 896), so those three default
to it. Queued, a static persistent schedule's last wave waits on its slowest tile; the
dynamic one hands tiles to whichever SM frees first. grad_W2 follows a rule instead (dynamic
and static tie there, 0.986-1.005x): its output [O, F] is small and its K (the tokens) long.
Where the output's 128x256 tiles fill fewer than ``SPLIT_K_WAVES`` waves of the SMs, cuBLAS
ran 0.76-0.91x quack's time (every shape with D <= 2048: 1.0-3.9 waves), likely because its
heuristics split K where quack's untuned tiles leave SMs idle; from 5.8 waves up, cuBLAS ran
1.00-1.07x quack's at 25 of 27 shapes (0.98x at the other two). No grid shape falls between
3.9 and 5.8 waves.
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

# quack's persistent GEMM on its static tile schedule, on its dynamic one (tiles handed out
# through a semaphore; what quack's own MLP runs its backward GEMMs on), or cuBLAS.
QUACK, QUACK_DYNAMIC, CUBLAS = "quack", "quack_dynamic", "cublas"
LIBRARIES = (QUACK, QUACK_DYNAMIC, CUBLAS)
# Without a measurement: the library that won at most measured shapes (see above).
DEFAULTS = {
    "fc2": CUBLAS,
    "grad_w2": QUACK,  # where its output fills SPLIT_K_WAVES waves or more; see default()
    "grad_x_packed": CUBLAS,
    "grad_w1_packed": QUACK_DYNAMIC,
    # drop_h_quack's grad_x and grad_W1: quack pairs the interleaved grad_preact with the
    # canonical fc1 inside one GEMM (concat_layout); cuBLAS needs a chunked copy or scatter per
    # step (``ops.concat_gemm``).
    "grad_x_concat": QUACK_DYNAMIC,
    "grad_w1_concat": QUACK_DYNAMIC,
}
SPLIT_K_WAVES = 5  # between the grid's 3.9 waves (cuBLAS faster) and 5.8 (quack faster)
WAVE_TILE = (128, 256)
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
        if not all(e.get("backend") in LIBRARIES for e in entries.values()):
            raise ValueError(f"a backend other than {', '.join(LIBRARIES)}")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        warnings.warn(
            f"{path}: unreadable GEMM cache ({e}); using the defaults. Delete it and run "
            "`swiglu-train pretune` again.",
            stacklevel=3,
        )
        return {}
    return {k: e["backend"] for k, e in entries.items()}


def default(gemm: str, m: int, n: int, sms: int) -> str:
    """The library for an [m, n] output of ``gemm`` that no pretune timed, on ``sms`` SMs."""
    if gemm == "grad_w2" and output_waves(m, n, sms) < SPLIT_K_WAVES:
        return CUBLAS
    return DEFAULTS[gemm]


def output_waves(m: int, n: int, sms: int) -> float:
    """How many waves of the SMs an [m, n] output's WAVE_TILE tiles make."""
    tiles = -(-m // WAVE_TILE[0]) * -(-n // WAVE_TILE[1])
    return tiles / sms


def choice(
    gemm: str, m: int, n: int, k: int, dtype: torch.dtype, device_name: str, sms: int
) -> str:
    """The library cached for this GEMM on this GPU, else the default."""
    cached = _choices(cache_path()).get(key(gemm, m, n, k, dtype, device_name))
    return cached or default(gemm, m, n, sms)


def backend(gemm: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """The library for ``a @ b`` as ``gemm`` on a's CUDA device. Under torch.compile, the
    plain ``DEFAULTS``: a traced graph reads neither the cache file nor the device's SMs."""
    if torch.compiler.is_compiling():
        return DEFAULTS[gemm]
    # get_device(), not device.index: the same index, without building a device object
    return _lookup(gemm, a.shape[0], b.shape[1], a.shape[1], a.dtype, a.get_device())


@functools.cache
def sm_count(device: int) -> int:
    """A CUDA device's SMs, asked once (the query costs host time on every step)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _lookup(gemm: str, m: int, n: int, k: int, dtype: torch.dtype, device: int) -> str:
    """``choice`` memoized per call signature: it runs on every step's GEMMs, where building
    the key and asking for the device's name each time would add host time."""
    return choice(gemm, m, n, k, dtype, torch.cuda.get_device_name(device), sm_count(device))


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
    """Merge measured entries (key -> {"backend", "<library>_ms", ...}) into the cache,
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
