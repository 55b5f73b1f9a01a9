"""``impl="auto"``: pick a concrete impl from the cost model fitted on this GPU family.

Why once, at construction, and not per forward: ``save_factors`` reads fc1 packed while
``normal`` and ``drop_h`` read it canonical, so the choice fixes the parameter layout, and an
optimizer's per-element state (Adam moments) is laid out like the parameters it was created
with. Switching per forward, as the token count varies, would repack fc1 under a live
optimizer. So ParMLP resolves ``auto`` once, from a tokens-per-micro-batch hint, before any
optimizer holds its parameters.

The rule: the model (``auto_model``) predicts each impl's step over the six-GEMM floor at
(tokens_hint, D, F); take the fastest predicted, and among impls predicted within
``PREDICTED_TIE`` of it the one with the least predicted after-forward memory. Impls this
machine cannot run (the quack impls without quack, off Hopper (sm_90, so on Blackwell too), or
with D, F or the output size not a multiple of 8) are left out first. The tie is 0.5 %, not the
1 % auto is judged by, because the model's own error on the ratio of two impls is about as large
(0.7 % median on the H200 grid): a 1 % tie traded measured speed for memory on the model's
errors (leaving each family out of the fit, 47 of 57 picks within 1 % of the fastest at a 1 %
tie, 53 at 0.5 %).

Why a fitted model and not the nearest measured point: impls differ by about 1 %, the noise of
one point, so a lookup copies that point's noise; the model's few terms per impl are fitted over
every point, and its 1/D and host terms follow why impls differ (activation bytes against GEMM
FLOPs, and host work at small shapes).

The model for a GPU family is the one calibrated on this machine (``bench-grid --calibrate``
writes it to ``calibration_path``), else the one shipped in this package: a user's own GPU
measured beats another machine's. A calibrated file of another family, or unreadable, is
refused in one warning and skipped, since a cache must never stop a run.

The fallback is ``drop_h``: it is never slower than ``normal`` by more than noise and saves
M·F·2 bytes per layer (h is recomputed instead of saved), while ``save_factors`` is a layout
change whose pay-off has to be measured. It applies with no tokens_hint, off CUDA, with no
model for this GPU family, and at a D the model does not reach (``AutoModel.d_range``). On a
CUDA GPU with no model it is announced once per process and family, naming the command that
calibrates it: a user must not take drop_h for a measured choice.
"""

from __future__ import annotations

import functools
import importlib.resources
import numbers
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from swiglu_train.layers.auto_model import MIB, AutoModel, Prediction, read_model
from swiglu_train.layers.registry import QUACK_IMPLS
from swiglu_train.ops.gemm_choice import cache_path
from swiglu_train.ops.quack_mlp import ALIGN, quack_available

FALLBACK = "drop_h"
CALIBRATE_COMMAND = "swiglu-train bench-grid --calibrate"
PREDICTED_TIE = 0.005  # impls predicted within 0.5 % of the fastest count as equally fast


@dataclass(frozen=True)
class Resolution:
    impl: str
    reason: str


def fastest_or_leanest(ratio: Mapping[str, float], memory: Mapping[str, float], tie: float) -> str:
    """The rule, on predictions (auto) or measurements (the benchmarks that judge it): among the
    impls within ``tie`` of the fastest ratio, the least memory, then the faster; registry
    order breaks exact ties."""
    best = min(ratio.values())
    close = [n for n in ratio if ratio[n] <= best * (1 + tie)]
    return min(close, key=lambda n: (memory[n], ratio[n]))


def choose(predictions: dict[str, Prediction]) -> tuple[str, str]:
    """The rule on predictions, with PREDICTED_TIE: (impl, why)."""
    fastest = min(predictions, key=lambda n: predictions[n].ratio)
    best = predictions[fastest].ratio
    pick = fastest_or_leanest(
        {n: p.ratio for n, p in predictions.items()},
        {n: p.after_forward_bytes for n, p in predictions.items()},
        PREDICTED_TIE,
    )
    p = predictions[pick]
    host = (
        f", host-bound (queuing a step takes {p.host_ms:.2f} ms, its GPU work {p.gpu_ms:.2f} ms)"
        if p.host_bound
        else ""
    )
    if pick == fastest:
        return pick, f"fastest predicted ({p.ratio:.3f}x the six-GEMM floor{host})"
    return pick, (
        f"predicted {p.ratio:.3f}x the six-GEMM floor{host}, within {PREDICTED_TIE:.1%} of "
        f"{fastest} ({best:.3f}x), with less after-forward memory "
        f"({p.after_forward_bytes / MIB:.0f} vs "
        f"{predictions[fastest].after_forward_bytes / MIB:.0f} MiB)"
    )


def resolve(
    tokens_hint: int | None,
    hidden_size: int,
    ffn_hidden_size: int,
    device_name: str | None,
    model: AutoModel | None,
    *,
    output_size: int | None = None,
    quack: bool | None = None,
) -> Resolution:
    """The concrete impl for ``auto`` (see the module docstring for the rule and fallback).

    ``device_name`` is None off CUDA; ``model`` is the model found for that device, or None
    (a model of another GPU family counts as none). ``output_size`` (fc2's, default D) is not
    a model term, but quack's kernels need it aligned like D and F. ``quack`` says whether
    quack runs on that device (None: ask this machine); the model-grid benchmark judges auto's
    choices for the GPU it measured from a CPU machine.
    """
    integral = isinstance(tokens_hint, numbers.Integral) and not isinstance(tokens_hint, bool)
    if tokens_hint is not None and (not integral or tokens_hint < 1):
        raise ValueError(f"tokens_hint must be a positive token count, got {tokens_hint!r}")

    def fallback(why: str) -> Resolution:
        return Resolution(FALLBACK, f"fallback to {FALLBACK}: {why}")

    if device_name is None:
        return fallback("not on a CUDA device, and the auto models are fitted on GPUs")
    family = gpu_family(device_name)
    if model is None or gpu_family(model.gpu_family) != family:
        return fallback(
            f"no auto model for GPU family {family!r} ({device_name}); calibrate this GPU "
            f"with: {CALIBRATE_COMMAND}"
        )
    if tokens_hint is None:
        return fallback("no tokens_hint (tokens per micro-batch) to predict the step at")
    low, high = model.d_range
    if not low <= hidden_size <= high:
        return fallback(
            f"D={hidden_size} is outside the range the model reaches ({low:g} to {high:g}: "
            f"within x2 of the D it was fitted at on {model.device_name})"
        )
    sizes = (hidden_size, ffn_hidden_size, hidden_size if output_size is None else output_size)
    quack_runs = quack_available() if quack is None else quack
    quack_fits = all(n % ALIGN == 0 for n in sizes) and quack_runs
    predictions = model.predict(tokens_hint, hidden_size, ffn_hidden_size)
    runnable = {n: p for n, p in predictions.items() if n not in QUACK_IMPLS or quack_fits}
    if not runnable:
        return fallback("none of the impls the model knows can run here (quack cannot)")
    impl, why = choose(runnable)
    return Resolution(
        impl,
        f"{impl}: {why} at M={tokens_hint}, D={hidden_size}, F={ffn_hidden_size}, by the cost "
        f"model fitted on {model.device_name} in {model.dtype}, commit {model.commit}",
    )


def gpu_family(device_name: str) -> str:
    """ "NVIDIA H200" -> "H200", "NVIDIA A100-SXM4-80GB" -> "A100": the first model token."""
    tokens = re.split(r"[\s\-_]+", device_name.upper())
    return next((t for t in tokens if t != "NVIDIA" and any(c.isdigit() for c in t)), tokens[0])


def model_filename(family: str) -> str:
    return f"auto_{re.sub(r'[^a-z0-9]', '', family.lower())}.json"


@functools.cache
def packaged_model(family: str) -> AutoModel | None:
    """The model shipped for a GPU family in this package, or None when there is none."""
    resource = importlib.resources.files("swiglu_train.layers").joinpath(model_filename(family))
    return read_model(resource) if resource.is_file() else None


def calibration_dir() -> Path:
    """Where this machine's calibrated models live: beside pretune's GEMM cache
    (``gemm_choice.cache_path``), so one directory holds what was measured here."""
    return cache_path().parent


def calibration_path(family: str) -> Path:
    """Where ``bench-grid --calibrate`` writes a family's model and auto looks first."""
    return calibration_dir() / model_filename(family)


@functools.cache  # per file, once a process: every layer of a model asks, one warning is enough
def calibrated_model(path: Path, family: str) -> AutoModel | None:
    """The model calibrated on this machine for ``family``, or None: none there, or refused
    (unreadable, or fitted on another GPU family) with one warning saying how to redo it."""
    if not path.is_file():
        return None
    try:
        model = read_model(path)
        if gpu_family(model.gpu_family) != family:
            raise ValueError(
                f"auto model {path}: fitted on GPU family {model.gpu_family!r} "
                f"({model.device_name}), not {family!r}"
            )
    except (OSError, ValueError) as e:
        warnings.warn(
            f"{e}; impl='auto' ignores it. Delete it, or calibrate this GPU with: "
            f"{CALIBRATE_COMMAND}",
            stacklevel=5,  # the line that built the layer: through find_model, resolve_auto
        )
        return None
    return model


def find_model(family: str) -> AutoModel | None:
    """The model auto reads for a GPU family: calibrated here, else shipped, else None."""
    found = find_model_file(family)
    return None if found is None else found[0]


def find_model_file(family: str) -> tuple[AutoModel, str] | None:
    """``find_model``'s model and where it came from: the calibration's path, or the shipped
    file's name (the benchmarks record which one judged their points)."""
    path = calibration_path(family)
    calibrated = calibrated_model(path, family)
    if calibrated is not None:
        return calibrated, str(path)
    shipped = packaged_model(family)
    return None if shipped is None else (shipped, model_filename(family))


@functools.cache  # once a process per family, not once per layer
def warn_uncalibrated(family: str) -> None:
    """The one line that says auto chose the fallback on a CUDA GPU it has no model for."""
    warnings.warn(
        f"impl='auto' builds {FALLBACK} on GPU family {family!r}: no auto model for it, neither "
        f"calibrated ({calibration_path(family)}) nor shipped, so the impls cannot be compared "
        f"there and {FALLBACK} (never slower than 'normal' beyond noise, h not saved) is the "
        f"safe choice; calibrate this GPU with: {CALIBRATE_COMMAND}",
        stacklevel=4,  # the line that built the layer: through resolve_auto and ParMLP
    )


def target_device_name(device: torch.device | str | None) -> str | None:
    """The CUDA device a new ParMLP will run on, or None when it runs elsewhere.

    An explicit ``device`` decides; with none (or ``meta``) the module is taken to be built
    before being moved, as Lightning and most training loops do, so the current CUDA device
    counts when there is one.
    """
    if device is not None and torch.device(device).type not in ("cuda", "meta"):
        return None
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def resolve_auto(
    tokens_hint: int | None,
    hidden_size: int,
    ffn_hidden_size: int,
    device: torch.device | str | None,
    *,
    output_size: int | None = None,
) -> Resolution:
    """``resolve`` with this machine's device and the model found for its family; with none,
    on CUDA, warns once (``warn_uncalibrated``)."""
    name = target_device_name(device)
    family = None if name is None else gpu_family(name)
    model = None if family is None else find_model(family)
    if family is not None and model is None:
        warn_uncalibrated(family)
    return resolve(tokens_hint, hidden_size, ffn_hidden_size, name, model, output_size=output_size)
