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
machine cannot run (the quack impls without quack, below sm_90, or with D, F or the output size
not a multiple of 8) are left out first. The tie is 0.5 %, not the 1 % auto is judged by,
because the model's own error on the ratio of two impls is about as large (0.7 % median on the
H200 grid): a 1 % tie traded measured speed for memory on the model's errors (leaving each
family out of the fit, 47 of 57 picks within 1 % of the fastest at a 1 % tie, 53 at 0.5 %).

Why a fitted model and not the nearest measured point: impls differ by about 1 %, the noise of
one point, so a lookup copies that point's noise; the model's few terms per impl are fitted over
every point, and its 1/D and host terms follow why impls differ (activation bytes against GEMM
FLOPs, and host work at small shapes).

The fallback is ``drop_h``: it is never slower than ``normal`` by more than noise and saves
M·F·2 bytes per layer (h is recomputed instead of saved), while ``save_factors`` is a layout
change whose pay-off has to be measured. It applies with no tokens_hint, off CUDA, with no
model for this GPU family, and at a D the model does not reach (``AutoModel.d_range``).
"""

from __future__ import annotations

import functools
import importlib.resources
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swiglu_train.layers.auto_model import MIB, AutoModel, Prediction, read_model
from swiglu_train.layers.registry import QUACK_IMPLS
from swiglu_train.ops.quack_mlp import ALIGN, quack_available

FALLBACK = "drop_h"
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
        return fallback(f"no auto model for GPU family {family!r} ({device_name})")
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
    """``resolve`` with this machine's device and this package's model for its family."""
    name = target_device_name(device)
    model = packaged_model(gpu_family(name)) if name is not None else None
    return resolve(tokens_hint, hidden_size, ffn_hidden_size, name, model, output_size=output_size)
