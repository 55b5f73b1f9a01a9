"""The impl registry: one name per way of trading activation memory against recompute."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from swiglu_train.layers.layout import Layout
from swiglu_train.ops import drop_h_mlp, normal_mlp, save_factors_mlp
from swiglu_train.ops.fp8_saved import drop_h_fp8_mlp
from swiglu_train.ops.quack_fp8_saved import drop_h_quack_fp8_mlp
from swiglu_train.ops.quack_mlp import drop_h_quack_mlp, require_quack
from swiglu_train.ops.quack_save_factors import CHUNK as QUACK_PAIR_CHUNK
from swiglu_train.ops.quack_save_factors import save_factors_quack_mlp

MLPFunction = Callable[..., torch.Tensor]

_IMPLS: dict[str, MLPFunction] = {
    "normal": normal_mlp,
    "drop_h": drop_h_mlp,
    "save_factors": save_factors_mlp,
    "drop_h_quack": drop_h_quack_mlp,
    "save_factors_quack": save_factors_quack_mlp,
}
MLP_IMPLS: tuple[str, ...] = tuple(_IMPLS)
# these read fc1 in packed layout
PACKED_IMPLS: frozenset[str] = frozenset({"save_factors", "save_factors_quack"})
FIXED_CHUNKS: dict[str, int] = {"save_factors_quack": QUACK_PAIR_CHUNK}  # set by the kernel
# quack's CuTe-DSL kernels: CUDA sm_90+ with quack-kernels installed; the others run anywhere
QUACK_IMPLS: frozenset[str] = frozenset({"drop_h_quack", "save_factors_quack"})
PORTABLE_IMPLS: tuple[str, ...] = tuple(n for n in MLP_IMPLS if n not in QUACK_IMPLS)
AUTO = "auto"  # not a function: ParMLP resolves it to one of MLP_IMPLS when built (layers/auto)
IMPL_CHOICES: tuple[str, ...] = (*MLP_IMPLS, AUTO)  # what a user may ask a ParMLP for
# saved_fp8=True: the impls that store their saved preactivation in FP8, and why the others don't
SAVED_FP8_IMPLS: dict[str, MLPFunction] = {
    "drop_h": drop_h_fp8_mlp,
    "drop_h_quack": drop_h_quack_fp8_mlp,
}
_NO_SAVED_FP8 = {
    "normal": "it saves h (fc2's input) as well as the preactivation, and only the "
    "preactivation has an FP8 copy",
    "save_factors": "it is not implemented for the saved SwiGLU factors: they survive FP8 as "
    "well as the preactivation does (docs/fp8.md), but h stays bf16 beside them, so x + h + FP8 "
    "factors would hold what bf16 drop_h holds (4 bytes per M·F element), twice drop_h's with "
    "saved_fp8 (2)",
    "save_factors_quack": "it is not implemented for the saved SwiGLU factors: they survive FP8 "
    "as well as the preactivation does (docs/fp8.md), but it needs quack epilogues that write "
    "and read them, and h stays bf16 beside them (drop_h's bf16 memory, not half of it)",
    AUTO: "auto may pick an impl that cannot store it; name impl 'drop_h'",
}


def check_impl_name(name: str) -> None:
    """A ValueError listing every name a user may choose (``auto`` included) for an unknown one."""
    if name not in IMPL_CHOICES:
        raise ValueError(f"unknown MLP impl {name!r}; valid impls: {', '.join(IMPL_CHOICES)}")


def packed_chunk(
    name: str, chunk: int | None, ffn_size: int, size_name: str = "the ffn size"
) -> int:
    """The packed layout's chunk for packed impl ``name`` on ``ffn_size`` rows per half
    (``size_name`` says which size that is, in the error).

    A kernel that fixes the chunk (save_factors_quack: 1) overrides a default but refuses a
    different explicit one; otherwise ``chunk``, or the largest power of two up to 128 dividing
    ``ffn_size`` (one 128-wide GEMM tile per chunk where the size allows).
    """
    if chunk is not None and (not isinstance(chunk, numbers.Integral) or isinstance(chunk, bool)):
        raise TypeError(f"chunk must be a whole number of rows, got {chunk!r}")
    if chunk is not None:  # a plain int: a numpy one would land in the state_dict's layout
        chunk = int(chunk)  # stamp, which torch.load(weights_only=True) refuses to unpickle
    fixed = FIXED_CHUNKS.get(name)
    if fixed is not None:
        if chunk not in (None, fixed):
            raise ValueError(f"impl {name!r} packs fc1 with chunk {fixed}, not chunk={chunk}")
        return fixed
    chunk = math.gcd(ffn_size, 128) if chunk is None else chunk
    if chunk < 1 or ffn_size % chunk:
        raise ValueError(f"chunk={chunk} must be positive and divide {size_name} {ffn_size}")
    return chunk


def impls_for_layout(layout: Layout) -> tuple[str, ...]:
    """The impls that keep fc1 in ``layout``, so the only names a checkpoint in that layout
    may carry as the impl it was saved by: canonical is every unpacked impl's, a packed
    layout save_factors' (any chunk) and that of an impl whose kernel fixes its chunk."""
    if not layout.packed:
        return tuple(n for n in MLP_IMPLS if n not in PACKED_IMPLS)
    return tuple(
        n
        for n in MLP_IMPLS
        if n in PACKED_IMPLS and FIXED_CHUNKS.get(n, layout.chunk) == layout.chunk
    )


def check_saved_fp8(name: str, saved_fp8: bool = True) -> None:
    """Refuse ``saved_fp8`` (a bool) for an impl that cannot store its saved tensors in FP8,
    with the reason; names that are no impl at all are left to the impl checks."""
    if not isinstance(saved_fp8, bool):
        raise TypeError(f"saved_fp8 must be True or False, got {saved_fp8!r}")
    if saved_fp8 and name in _NO_SAVED_FP8:
        raise ValueError(
            f"saved_fp8=True is for impls {' and '.join(map(repr, SAVED_FP8_IMPLS))} only, "
            f"not {name!r}: {_NO_SAVED_FP8[name]}"
        )


# How an impl with saved_fp8 is named where runs and tables are compared (the planner's candidates,
# the memory profiler's per-impl figures, bench_e2e's rows): "drop_h+fp8" stands apart from the
# bf16 "drop_h", whose parameters and impl name it shares.
FP8_LABEL = "+fp8"


def saved_fp8_labels(quack: bool) -> list[str]:
    """The labels of the impls that store their saved preactivation in FP8 (``drop_h+fp8``,
    and ``drop_h_quack+fp8`` where ``quack`` runs): a planner's candidates with saved_fp8."""
    return [name + FP8_LABEL for name in SAVED_FP8_IMPLS if quack or name not in QUACK_IMPLS]


def impl_label(name: str, saved_fp8: bool, float8: str | None = None) -> str:
    """``name``, with ``+fp8`` when its saved preactivation is stored in FP8, and
    ``_float8_RECIPE`` when its GEMMs ran on torchao's FP8 recipe (as the benchmark variants
    are named)."""
    label = name + FP8_LABEL if saved_fp8 else name
    return f"{label}_float8_{float8}" if float8 else label


def get_impl(name: str, saved_fp8: bool = False) -> MLPFunction:
    """The MLP function for a concrete impl name (its FP8-saving variant with ``saved_fp8``),
    or a ValueError that lists the valid names or says why the impl has no FP8 variant.

    A quack impl also needs quack itself: an ImportError says so here, when a model is built,
    rather than at its first forward.
    """
    check_saved_fp8(name, saved_fp8)
    if name in QUACK_IMPLS:
        require_quack()
    if saved_fp8 and name in SAVED_FP8_IMPLS:
        return SAVED_FP8_IMPLS[name]
    try:
        return _IMPLS[name]
    except KeyError:
        valid = ", ".join(MLP_IMPLS)
        if name == AUTO:
            raise ValueError(
                f"impl {AUTO!r} is resolved once, when a ParMLP is built "
                f"(ParMLP(..., impl='auto', tokens_hint=...)); here give one of: {valid}"
            ) from None
        raise ValueError(f"unknown MLP impl {name!r}; valid impls: {valid}") from None
