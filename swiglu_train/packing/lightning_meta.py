"""A converted Lightning checkpoint's record and saved init args, kept true to its new layout.

The record (``swiglu_train``) names the impl that saved the file, which people and scripts read
as the impl its fc1 is laid out for. The saved init args (``hyper_parameters``) name the impl
and pack chunk ``load_from_checkpoint`` builds; they are made to name those of the new layout,
or the model built from them could not take the file.
"""

from __future__ import annotations

from swiglu_train.layers.layout import CANONICAL, Layout
from swiglu_train.layers.registry import (
    IMPL_CHOICES,
    MLP_IMPLS,
    PACKED_IMPLS,
    impls_for_layout,
    packed_chunk,
)
from swiglu_train.packing.checkpoint_read import CKPT_KEY

HPARAMS_KEY = "hyper_parameters"  # Lightning's saved init args: model.mlp_impl, model.mlp_chunk
CANONICAL_IMPL = "drop_h"  # recorded for canonical fc1: ModelConfig's default, runs anywhere


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


def fit_hparams_impl(ckpt: dict, target: Layout, ffn_sizes: set[int]) -> None:
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


def record_conversion(meta: dict, source: Layout | None, target: Layout) -> None:
    """Record fc1's new layout, and keep the saving impl's name only where it still holds.

    ``mlp_impl`` names the impl that saved the checkpoint; after a conversion it must not name
    one whose layout is not the file's. Several impls share a layout (canonical: normal,
    drop_h, drop_h_quack), so no single name can replace it: a stale one is dropped, and each
    conversion that moved fc1 or dropped the name is appended to ``converted`` with the impl it
    was saved by.
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
