"""What a checkpoint says about its ParMLP fc1s: where they are, and which layout they are in.

fc1 entries are found by structure: ``<prefix>fc1.weight`` [2F, D] beside ``<prefix>fc2.weight``
[O, F]. Their layout is read from what the checkpoint records: a packed ParMLP's stamp, and our
Lightning checkpoints' ``swiglu_train.fc1_layout``. Checkpoints whose records contradict each
other, or whose fc1 shares memory with an entry convert would not move, are refused here.
"""

from __future__ import annotations

import torch

from swiglu_train.layers.layout import CANONICAL, STAMP_FIELD, Layout, read_stamp
from swiglu_train.layers.par_mlp import STAMP_KEY

CKPT_KEY = "swiglu_train"  # where Lightning checkpoints record layout and optimizer names


def records_layout(ckpt: dict) -> bool:
    """Whether ``ckpt`` says which layout its fc1 weights are in: a stamp or a Lightning record."""
    lightning = "state_dict" in ckpt
    if lightning and ckpt.get(CKPT_KEY, {}).get("fc1_layout") is not None:
        return True
    return bool(stamp_keys(ckpt["state_dict"] if lightning else ckpt))


def stamp_keys(state: dict) -> list[str]:
    """Keys of ParMLP layout stamps; other modules' ``_extra_state`` (TE's, say) are not."""
    return [
        k for k, v in state.items()
        if k.endswith(STAMP_KEY) and isinstance(v, dict) and STAMP_FIELD in v
    ]  # fmt: skip


def lightning_record(ckpt: dict) -> Layout | None:
    """The fc1 layout our PretrainModule records: its model's ParMLPs all share one."""
    recorded = ckpt.get(CKPT_KEY, {}).get("fc1_layout")
    return None if recorded is None else Layout.from_dict(recorded, f"{CKPT_KEY}.fc1_layout")


def recorded_layout(
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


def mlp_prefixes(state: dict) -> list[str]:
    """The prefixes of the ParMLPs in ``state``: fc1.weight [2F, D] beside fc2.weight [O, F]."""
    prefixes = []
    for key, value in state.items():
        if not key.endswith("fc1.weight"):
            continue
        prefix = key[: -len("fc1.weight")]
        fc2 = state.get(prefix + "fc2.weight")
        if fc2 is not None and value.dim() == 2 and value.shape[0] == 2 * fc2.shape[1]:
            prefixes.append(prefix)
    return prefixes


def check_ties(state: dict, prefixes: list[str]) -> None:
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
