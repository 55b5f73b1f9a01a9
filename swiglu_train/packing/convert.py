"""Convert checkpoints between the canonical and packed fc1 layouts, optimizer state included.

A checkpoint is a bare state_dict, or a Lightning-style dict (``state_dict`` plus
``optimizer_states``). Its ParMLP fc1s and the layouts it records for them are read by
:mod:`~swiglu_train.packing.checkpoint_read`. A layout the caller assumes must agree with a
recorded one: reading rows in the wrong layout would scramble fc1 without any error. Optimizer
state is mapped through the parameter names the checkpoint records
(:mod:`~swiglu_train.packing.optimizer`). A Lightning checkpoint's record and saved init args
are made to name the new layout (:mod:`~swiglu_train.packing.lightning_meta`).
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass

from swiglu_train.layers.layout import CANONICAL, Layout, order, stamp
from swiglu_train.layers.par_mlp import STAMP_KEY
from swiglu_train.packing.checkpoint_read import (
    CKPT_KEY,
    check_ties,
    lightning_record,
    mlp_prefixes,
    recorded_layout,
    stamp_keys,
)
from swiglu_train.packing.lightning_meta import fit_hparams_impl, record_conversion
from swiglu_train.packing.optimizer import check_optimizer_names, move_optimizer_state

DEFAULT_CHUNK = 128
# Routed experts' fc1 [E, 2F, D] (ParExperts', and transformers 5's gate_up_proj that patch
# adopts): canonical [gate; up] per expert in every impl, so never converted
EXPERTS_FC1 = ("fc1_weight", "gate_up_proj")


@dataclass
class Converted:
    """One fc1 moved by :func:`convert_checkpoint`, for the report table."""

    prefix: str
    source: str
    target: str
    optimizer_states: int


def convert_checkpoint(
    ckpt: dict,
    to: str,
    chunk: int | None = None,
    assume_layout: Layout | None = None,
    report: list[Converted] | None = None,
) -> dict:
    """A converted copy of ``ckpt`` with every ParMLP fc1 (and its optimizer state) in ``to``.

    ``to`` is "packed" (with ``chunk``, 128 by default) or "canonical". fc1 weights whose
    layout the checkpoint does not record are read as ``assume_layout`` (canonical by default:
    the ecosystem's layout); one it records must agree with ``assume_layout`` when given.
    A Lightning record gets the new layout, and keeps its ``mlp_impl`` only where that impl's
    layout is the new one (:func:`record_conversion`); the saved init args' ``model.mlp_impl``
    and ``model.mlp_chunk`` are made to build fc1 in the new layout
    (:func:`fit_hparams_impl`), all else in them is kept.
    """
    if to not in ("packed", "canonical"):
        raise ValueError(f"to must be 'packed' or 'canonical', got {to!r}")
    if chunk is not None:  # a numpy integer is stamped as the int the stamp reader takes
        if not isinstance(chunk, numbers.Integral) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive number of rows, got {chunk!r}")
        chunk = int(chunk)
    lightning = "state_dict" in ckpt
    out = copy.deepcopy(ckpt)
    state = out["state_dict"] if lightning else out
    record = lightning_record(out) if lightning else None
    names = out.get(CKPT_KEY, {}).get("optimizer_param_names")
    if lightning and out.get("optimizer_states"):
        check_optimizer_names(out["optimizer_states"], names)
    prefixes = mlp_prefixes(state)
    experts = [
        k for k, v in state.items() if k.endswith(EXPERTS_FC1) and getattr(v, "ndim", 0) == 3
    ]
    if not prefixes and experts:
        raise ValueError(
            f"no ParMLP fc1 weights, only routed experts ({experts[0]} [E, 2F, D], ...), whose "
            "fc1 every impl keeps canonical: there is no layout to convert (export-hf writes "
            "an MoE pretrain checkpoint for transformers)"
        )
    if not prefixes:
        raise ValueError(
            "no ParMLP fc1 weights found (expected '<prefix>fc1.weight' beside "
            "'<prefix>fc2.weight' with matching sizes)"
        )
    check_ties(state, prefixes)
    stamps = stamp_keys(state)
    stray = sorted(set(stamps) - {p + STAMP_KEY for p in prefixes})
    if stray:  # e.g. Megatron's mlp._extra_state beside linear_fc1: its rows would go unread
        raise ValueError(
            f"{stray[0]} records an fc1 layout, but no '<prefix>fc1.weight' beside "
            "'<prefix>fc2.weight' sits under it; a Megatron state_dict converts by loading it "
            "into ParMLPMegatron, not with convert"
        )
    recorded = record is not None or bool(stamps)
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    target, sources = CANONICAL, set()
    for prefix in prefixes:
        source = recorded_layout(state, prefix, record, recorded)
        if source is not None and assume_layout is not None and source != assume_layout:
            raise ValueError(
                f"{prefix}fc1 is recorded as {source} but assumed to be {assume_layout}; "
                "the recorded layout is used when no layout is assumed"
            )
        source = source or assume_layout or CANONICAL
        sources.add(source)
        rows = state[prefix + "fc1.weight"].shape[0]
        target = CANONICAL if to == "canonical" else Layout("packed", chunk, source.tp)
        try:
            index = order(rows, source, target)
        except ValueError as e:  # layout.py's message names the sizes, not the layer
            raise ValueError(f"{prefix}fc1.weight [{rows} rows] cannot go {source} -> {target}: "
                             f"{e}") from e  # fmt: skip
        moved_states = 0
        if index is not None:
            for key in ("fc1.weight", "fc1.bias"):
                if prefix + key in state:
                    state[prefix + key] = state[prefix + key].index_select(0, index)
                    moved_states += move_optimizer_state(out, names, prefix + key, index)
        if target.packed:
            state[prefix + STAMP_KEY] = stamp(target)
        if report is not None:
            report.append(Converted(prefix, str(source), str(target), moved_states))
    if lightning and CKPT_KEY in out:
        source = record or (next(iter(sources)) if len(sources) == 1 else None)
        record_conversion(out[CKPT_KEY], source, target)
    if lightning:
        ffn_sizes = {state[prefix + "fc1.weight"].shape[0] // 2 for prefix in prefixes}
        fit_hparams_impl(out, target, ffn_sizes)
    return out
