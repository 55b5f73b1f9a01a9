"""Switch a live model between layouts, and convert checkpoints between them.

A checkpoint is a bare state_dict, or a Lightning-style dict (``state_dict`` plus
``optimizer_states``). ParMLP fc1 entries are found by structure: ``<prefix>fc1.weight``
[2F, D] beside ``<prefix>fc2.weight`` [O, F]. Their layout is read from what the checkpoint
records: a packed ParMLP's stamp, and our Lightning checkpoints' ``swiglu_train.fc1_layout``.
A layout the caller assumes must agree with a recorded one: reading rows in the wrong layout
would scramble fc1 without any error. Optimizer state is mapped through the parameter names
the checkpoint records; without them the mapping would be a guess, so it is refused.
A Lightning checkpoint's saved init args name the impl and pack chunk ``load_from_checkpoint``
builds; they are made to name those of the new layout, or the model built from them could not
take the file.
"""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass

import torch
from torch import nn

from swiglu_train.layers import ParMLP
from swiglu_train.layers.layout import CANONICAL, STAMP_FIELD, Layout, order, read_stamp, stamp
from swiglu_train.layers.par_mlp import STAMP_KEY
from swiglu_train.layers.registry import (
    IMPL_CHOICES,
    MLP_IMPLS,
    PACKED_IMPLS,
    impls_for_layout,
    packed_chunk,
)
from swiglu_train.packing.optimizer import permute_state

CKPT_KEY = "swiglu_train"  # where Lightning checkpoints record layout and optimizer names
HPARAMS_KEY = "hyper_parameters"  # Lightning's saved init args: model.mlp_impl, model.mlp_chunk
CANONICAL_IMPL = "drop_h"  # recorded for canonical fc1: ModelConfig's default, runs anywhere
DEFAULT_CHUNK = 128


def switch_impl(
    model: nn.Module, impl: str, optimizer: torch.optim.Optimizer | None = None
) -> list[str]:
    """Switch every ParMLP to ``impl``, repacking fc1 and its optimizer state together.

    Every layer's new layout and optimizer state are worked out before any is changed, so a
    switch that cannot be made (a chunk that does not divide F, a factored optimizer state, an
    fc1 the optimizer does not hold) leaves the model and optimizer as they were. Returns the
    names of the ParMLPs whose layout changed.
    """
    plans = []
    owned = (
        set() if optimizer is None else {id(q) for g in optimizer.param_groups for q in g["params"]}
    )
    for name, mlp in model.named_modules():
        if not isinstance(mlp, ParMLP):
            continue
        index, states = mlp.layout_change(impl), {}
        if index is not None and optimizer is not None:
            for kind, p in (("weight", mlp.fc1.weight), ("bias", mlp.fc1.bias)):
                where = f"{name}.fc1" if name else "fc1"
                if p is not None and p.requires_grad and id(p) not in owned:
                    raise ValueError(
                        f"{where}.{kind} is not one of the optimizer's parameters, so its state "
                        "could not follow the layout change (under FSDP2 a root module keeps "
                        "its parameters unsharded after a forward: call model.reshard() first)"
                    )
                if p is not None and optimizer.state.get(p):
                    states[p] = permute_state(optimizer.state[p], p.shape, index, where)
        plans.append((name, mlp, index, states))
    for _, mlp, _, states in plans:
        mlp.set_impl(impl)
        if optimizer is not None:
            optimizer.state.update(states)
    return [name for name, _, index, _ in plans if index is not None]


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
    layout is the new one (:func:`_record_conversion`); the saved init args'
    ``model.mlp_impl`` and ``model.mlp_chunk`` are made to build fc1 in the new layout
    (:func:`_fit_hparams_impl`), all else in them is kept.
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
    record = _lightning_record(out) if lightning else None
    names = out.get(CKPT_KEY, {}).get("optimizer_param_names")
    if lightning and out.get("optimizer_states"):
        _check_optimizer_names(out["optimizer_states"], names)
    prefixes = _mlp_prefixes(state)
    if not prefixes:
        raise ValueError(
            "no ParMLP fc1 weights found (expected '<prefix>fc1.weight' beside "
            "'<prefix>fc2.weight' with matching sizes)"
        )
    _check_ties(state, prefixes)
    stamps = _stamp_keys(state)
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
        source = _recorded_layout(state, prefix, record, recorded)
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
                    moved_states += _move_optimizer_state(out, names, prefix + key, index)
        if target.packed:
            state[prefix + STAMP_KEY] = stamp(target)
        if report is not None:
            report.append(Converted(prefix, str(source), str(target), moved_states))
    if lightning and CKPT_KEY in out:
        source = record or (next(iter(sources)) if len(sources) == 1 else None)
        _record_conversion(out[CKPT_KEY], source, target)
    if lightning:
        ffn_sizes = {state[prefix + "fc1.weight"].shape[0] // 2 for prefix in prefixes}
        _fit_hparams_impl(out, target, ffn_sizes)
    return out


def built_layout(impl: str, ffn_size: int, chunk: int | None = None) -> Layout:
    """The fc1 layout of ``ParMLP(..., impl=impl, chunk=chunk)``, as PretrainModule's decoder
    builds it from ``model.mlp_impl`` and ``model.mlp_chunk`` (None: the impl's default)."""
    if impl not in PACKED_IMPLS:
        return CANONICAL
    return Layout("packed", packed_chunk(impl, chunk, ffn_size))


def _hparams_model(ckpt: dict) -> dict | None:
    """The saved init args' ``model`` dict (None: none, or an old Namespace)."""
    hparams = ckpt.get(HPARAMS_KEY)
    model = hparams.get("model") if isinstance(hparams, dict) else None
    return model if isinstance(model, dict) else None


def hparams_impl(ckpt: dict) -> str | None:
    """The impl name in a Lightning checkpoint's saved init args (``model.mlp_impl``), if any."""
    impl = (_hparams_model(ckpt) or {}).get("mlp_impl")
    return impl if impl in IMPL_CHOICES else None


def hparams_chunk(ckpt: dict) -> int | None:
    """The pack chunk in a Lightning checkpoint's saved init args (``model.mlp_chunk``; None
    where unset, or in a checkpoint saved before the setting existed)."""
    return (_hparams_model(ckpt) or {}).get("mlp_chunk")


def _fit_hparams_impl(ckpt: dict, target: Layout, ffn_sizes: set[int]) -> None:
    """Make the saved init args name an impl and chunk whose model holds fc1 in ``target``.

    ``load_from_checkpoint`` builds the model from them, so the impl and chunk the file was
    saved by would build the old layout and refuse the file (its optimizer state would be
    misread). Unlike the record's label, the name cannot simply be dropped: the model needs one
    (and ModelConfig's default is canonical). ``model.mlp_chunk`` becomes the new chunk for
    packed fc1 and None (cleared) for canonical. The name is kept where it builds ``target``
    with that chunk; else the record's resolved impl where that does (``auto`` is pinned: it
    could resolve to another layout on another machine); else drop_h for canonical,
    save_factors for packed (which builds any chunk dividing F, chunk 1 included, on any
    device).
    """
    old = hparams_impl(ckpt)
    if old is None:
        return
    chunk = target.chunk if target.packed else None

    def builds(impl: object) -> bool:
        if impl not in MLP_IMPLS:
            return False
        try:
            return all(built_layout(impl, f, chunk) == target for f in ffn_sizes)
        except ValueError:  # save_factors_quack's chunk is 1, whatever is asked
            return False

    recorded = ckpt.get(CKPT_KEY, {}).get("mlp_impl")  # kept only if it reads the new layout
    default = "save_factors" if target.packed else CANONICAL_IMPL
    new = next(impl for impl in (old, recorded, default) if builds(impl) or impl == default)
    model = ckpt[HPARAMS_KEY]["model"]
    model["mlp_impl"] = new
    if target.packed or "mlp_chunk" in model:  # an older file's init args lack it: None anyway
        model["mlp_chunk"] = chunk


def _record_conversion(meta: dict, source: Layout | None, target: Layout) -> None:
    """Record fc1's new layout, and keep the saving impl's name only where it still holds.

    ``mlp_impl`` names the impl that saved the checkpoint, which people and scripts read as
    the impl its fc1 is laid out for; after a conversion it must not name one whose layout is
    not the file's. Several impls share a layout (canonical: normal, drop_h, drop_h_quack), so
    no single name can replace it: a stale one is dropped, and each conversion that moved fc1
    or dropped the name is appended to ``converted`` with the impl it was saved by.
    """
    meta["fc1_layout"] = target.to_dict()
    impl = meta.get("mlp_impl")
    stale = impl is not None and impl not in impls_for_layout(target)
    if source != target or stale:
        meta.setdefault("converted", []).append({
            "from_fc1_layout": None if source is None else source.to_dict(),
            "to_fc1_layout": target.to_dict(),
            "mlp_impl": impl,
        })  # fmt: skip
    if stale:
        del meta["mlp_impl"]


def records_layout(ckpt: dict) -> bool:
    """Whether ``ckpt`` says which layout its fc1 weights are in: a stamp or a Lightning record."""
    lightning = "state_dict" in ckpt
    if lightning and ckpt.get(CKPT_KEY, {}).get("fc1_layout") is not None:
        return True
    return bool(_stamp_keys(ckpt["state_dict"] if lightning else ckpt))


def _stamp_keys(state: dict) -> list[str]:
    """Keys of ParMLP layout stamps; other modules' ``_extra_state`` (TE's, say) are not."""
    return [
        k for k, v in state.items()
        if k.endswith(STAMP_KEY) and isinstance(v, dict) and STAMP_FIELD in v
    ]  # fmt: skip


def _lightning_record(ckpt: dict) -> Layout | None:
    """The fc1 layout our PretrainModule records: its model's ParMLPs all share one."""
    recorded = ckpt.get(CKPT_KEY, {}).get("fc1_layout")
    return None if recorded is None else Layout.from_dict(recorded, f"{CKPT_KEY}.fc1_layout")


def _recorded_layout(
    state: dict, prefix: str, record: Layout | None, recorded: bool
) -> Layout | None:
    """The layout the checkpoint records for one fc1 (its stamp is popped), or None.

    ParMLP stamps every packed fc1 and loads an unstamped one as canonical, so in a file that
    records layouts (a Lightning record, or any stamp) an unstamped fc1 reads as canonical.
    Where stamp and record disagree, trusting either one could scramble fc1, so the
    checkpoint is refused.
    """
    key = prefix + STAMP_KEY
    raw = state.pop(key, None)
    stamped = None if raw is None else read_stamp(raw, key)
    if record is not None and (stamped or CANONICAL) != record:
        raise ValueError(
            f"{prefix}fc1 is stamped {stamped or 'canonical (no stamp)'} but the checkpoint "
            f"records {record} ({CKPT_KEY}.fc1_layout); it contradicts itself"
        )
    return stamped or (CANONICAL if recorded else None)


def _mlp_prefixes(state: dict) -> list[str]:
    prefixes = []
    for key, value in state.items():
        if not key.endswith("fc1.weight"):
            continue
        prefix = key[: -len("fc1.weight")]
        fc2 = state.get(prefix + "fc2.weight")
        if fc2 is not None and value.dim() == 2 and value.shape[0] == 2 * fc2.shape[1]:
            prefixes.append(prefix)
    return prefixes


def _check_ties(state: dict, prefixes: list[str]) -> None:
    """Refuse an fc1 weight or bias whose memory another entry that is not moved shares.

    Only fc1 rows are re-ordered: a tied twin elsewhere (an embedding, another module's weight)
    would keep the old order, and loading both into the one parameter keeps whichever comes
    last, so fc1 could load scrambled without an error. fc1s tied to each other (one ParMLP
    shared by several layers) move alike; tensors that merely share a buffer without
    overlapping (Megatron's contiguous parameter buffer) are independent.
    """
    moved = {p + k for p in prefixes for k in ("fc1.weight", "fc1.bias") if p + k in state}
    spans = {k: _span(v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel()}
    for key in sorted(moved & spans.keys()):
        storage, start, end = spans[key]
        for other, (storage2, start2, end2) in spans.items():
            if other not in moved and storage2 == storage and start < end2 and start2 < end:
                raise ValueError(
                    f"{key} shares its memory with {other}, which is not an fc1 convert moves; "
                    "re-ordering fc1's rows would untie them, so fc1 could load scrambled"
                )


def _span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """The storage and the byte range ``tensor`` reads from it."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.untyped_storage().data_ptr(), start, start + (last + 1) * size


def _check_optimizer_names(optimizer_states: list, names: object) -> None:
    """Refuse optimizer state whose parameters the recorded names do not name one to one.

    Optimizer state_dicts key state by integer ids listed per param group, and our record
    names the parameters of one optimizer, group by group. Pairing them any other way (the
    names of one optimizer read against another's ids, or no names at all) would permute some
    state and leave the rest scrambled, without an error.
    """
    where = f"{CKPT_KEY}.optimizer_param_names"
    if names is None:
        raise ValueError(
            f"checkpoint has optimizer_states but no recorded parameter names ({where}); "
            "mapping them would be a guess"
        )
    if len(optimizer_states) != 1:
        raise ValueError(
            f"checkpoint has {len(optimizer_states)} optimizer states but {where} names the "
            "parameters of one optimizer; which names go with which state would be a guess"
        )
    opt = optimizer_states[0]
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list):
        raise ValueError("optimizer_states[0] is not an optimizer state_dict (no param_groups)")
    sizes = [len(group["params"]) for group in opt["param_groups"]]
    groups = isinstance(names, list) and all(isinstance(g, list) for g in names)
    named = [len(g) for g in names] if groups else names
    if not groups or named != sizes:
        raise ValueError(
            f"{where} has groups of {named} names, but optimizer_states[0]'s param groups hold "
            f"{sizes} parameters; mapping them would be a guess"
        )


def _move_optimizer_state(ckpt: dict, names: list[list[str]] | None, key: str, index) -> int:
    """Permute the state of parameter ``key`` in the optimizer; returns how many moved.

    The recorded names per group pair with the state ids one to one
    (:func:`_check_optimizer_names`).
    """
    moved = 0
    for opt in ckpt.get("optimizer_states") or []:
        for group_names, group in zip(names, opt["param_groups"], strict=True):
            for name, param_id in zip(group_names, group["params"], strict=True):
                if name == key and param_id in opt["state"]:
                    shape = ckpt["state_dict"][key].shape
                    opt["state"][param_id] = permute_state(
                        opt["state"][param_id], shape, index, key
                    )
                    moved += 1
    return moved


HF_NAMES = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def to_hf(
    ckpt: dict, report: list[Converted] | None = None, assume_layout: Layout | None = None
) -> dict:
    """A bare state_dict with every ParMLP as HF Llama's gate_proj / up_proj / down_proj.

    ``ckpt`` may be a Lightning checkpoint: its weights are read in the layout it records.
    Its optimizer state is left behind, as an HF state_dict has no place for it.
    """
    lightning = "state_dict" in ckpt
    if lightning:
        ckpt = {"state_dict": ckpt["state_dict"], CKPT_KEY: ckpt.get(CKPT_KEY, {})}
    moved: list[Converted] = []
    out = convert_checkpoint(ckpt, to="canonical", assume_layout=assume_layout, report=moved)
    if lightning:
        out = out["state_dict"]
    if report is not None:
        report.extend(Converted(r.prefix, r.source, "hf", 0) for r in moved)
    for prefix in _mlp_prefixes(out):
        if prefix + "fc1.bias" in out or prefix + "fc2.bias" in out:
            raise ValueError(f"{prefix}: HF's gated MLP has no biases; this ParMLP has them")
        gate, up = out.pop(prefix + "fc1.weight").chunk(2)
        down = out.pop(prefix + "fc2.weight")
        for name, value in zip(HF_NAMES, (gate, up, down), strict=True):
            out[prefix + name] = value.contiguous()
    return out


def _check_hf_shapes(prefix: str, gate, up, down) -> None:
    """gate_proj and up_proj [F, D], down_proj [O, F]: anything else would load into a ParMLP
    of another size with its gate and up rows mixed, without an error."""
    tensors = {"gate_proj": gate, "up_proj": up, "down_proj": down}
    odd = {n: type(t).__name__ for n, t in tensors.items() if not isinstance(t, torch.Tensor)}
    if odd:
        raise ValueError(f"{prefix}: HF weights must be tensors; got {odd}")
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    two_d = gate.dim() == 2 and down.dim() == 2
    if not two_d or up.shape != gate.shape or down.shape[1] != gate.shape[0]:
        raise ValueError(f"{prefix}: expected gate_proj and up_proj [F, D] and down_proj [O, F]"
                         f" with one F; got {shapes}")  # fmt: skip


def from_hf(state: dict, report: list[Converted] | None = None) -> dict:
    """The inverse of :func:`to_hf`: canonical ParMLP fc1 = [gate_proj; up_proj]."""
    out = dict(state)
    prefixes = [k[: -len(HF_NAMES[0])] for k in state if k.endswith(HF_NAMES[0])]
    if not prefixes:
        raise ValueError("no HF gated MLPs found (expected '<prefix>gate_proj.weight')")
    for prefix in prefixes:
        missing = [n for n in HF_NAMES if prefix + n not in out]
        if missing:
            raise ValueError(f"{prefix}: HF gated MLP lacks {missing}")
        gate, up, down = (out.pop(prefix + n) for n in HF_NAMES)
        _check_hf_shapes(prefix, gate, up, down)
        biases = [prefix + n.replace("weight", "bias") for n in HF_NAMES]
        if any(b in out for b in biases):  # mlp_bias=True: ParMLP's fc1 bias has no HF twin here
            raise ValueError(f"{prefix}: HF MLP biases ({', '.join(b for b in biases if b in out)})"
                             " are not converted; only bias-free gated MLPs are")  # fmt: skip
        taken = [prefix + k for k in ("fc1.weight", "fc2.weight") if prefix + k in out]
        if taken:
            raise ValueError(f"{prefix}: the state already holds {taken}; not overwriting them")
        out[prefix + "fc1.weight"] = torch.cat([gate, up])
        out[prefix + "fc2.weight"] = down
        if report is not None:
            report.append(Converted(prefix, "hf", "canonical", 0))
    return out
