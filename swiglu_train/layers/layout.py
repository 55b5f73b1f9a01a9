"""The fc1 row layouts, and the exact permutations between them.

canonical  [W_gate; W_up]: Megatron-core's and HF's layout, what every checkpoint stores.
packed     [gate_0 | up_0 | gate_1 | up_1 | ...] in chunks of C rows, so one GEMM tile of
           2C output columns holds a whole (gate, up) pair. Under tensor parallelism each
           rank packs its own local shard: the global packed tensor is the concatenation of
           tp packed shards, and a rank never holds half a pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # a torch built without distributed: no tensor is a DTensor
    DTensor = distribute_tensor = None


KINDS = ("canonical", "packed")
STAMP_FIELD = "fc1_layout"  # a ParMLP stamp is {"fc1_layout": Layout.to_dict()}


@dataclass(frozen=True)
class Layout:
    kind: str = "canonical"  # "canonical" or "packed"
    chunk: int | None = None
    tp: int = 1

    def __post_init__(self) -> None:
        problem = _field_problem(self.kind, self.chunk, self.tp)
        if problem is not None:
            raise ValueError(problem)

    @property
    def packed(self) -> bool:
        return self.kind == "packed"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chunk": self.chunk, "tp": self.tp}

    @classmethod
    def from_dict(cls, stamp: object, where: str = "fc1 layout") -> Layout:
        """Read what :meth:`to_dict` wrote; anything else is refused, naming ``where`` (the
        key it was read from), the field and the value."""
        if not isinstance(stamp, dict) or set(stamp) != {"kind", "chunk", "tp"}:
            raise ValueError(
                f"{where}: unrecognised fc1 layout stamp {stamp!r}; expected a dict of "
                "exactly kind, chunk and tp"
            )
        problem = _field_problem(stamp["kind"], stamp["chunk"], stamp["tp"])
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        return cls(**stamp)

    def __str__(self) -> str:
        return "canonical" if not self.packed else f"packed(chunk={self.chunk}, tp={self.tp})"


def _count(value: object) -> bool:
    """A positive int as the writer stores it: not a bool (True == 1), a float, a str or a
    numpy integer (which torch.load(weights_only=True) would not even unpickle)."""
    return type(value) is int and value >= 1


def _shown(value: object) -> str:
    """The value, with its type where its repr hides it (True, 32.0, numpy's 16)."""
    plain = type(value) in (int, str, type(None))
    return repr(value) if plain else f"{value!r} ({type(value).__name__})"


def _field_problem(kind: object, chunk: object, tp: object) -> str | None:
    """What is wrong with these layout fields, naming the field and the value; None if nothing.

    Only what :meth:`Layout.to_dict` writes is accepted: a stamp read any looser (a chunk of
    True taken as 1) would reorder fc1's rows in a layout it was never written in.
    """
    if type(kind) is not str or kind not in KINDS:
        return f"unknown fc1 layout kind {_shown(kind)} (field 'kind'); use 'canonical' or 'packed'"
    if kind == "packed" and not _count(chunk):
        return (
            f"field 'chunk' is {_shown(chunk)}: a packed layout needs a positive chunk, an int "
            "number of rows"
        )
    if kind == "canonical" and chunk is not None:
        return f"field 'chunk' is {_shown(chunk)}: a canonical layout has no chunk (None)"
    if not _count(tp):
        return f"field 'tp' is {_shown(tp)}: the tensor-parallel size is a positive int"
    return None


def stamp(layout: Layout) -> dict:
    """A ParMLP layout stamp: ``{"fc1_layout": {"kind", "chunk", "tp"}}``."""
    return {STAMP_FIELD: layout.to_dict()}


def read_stamp(raw: object, key: str) -> Layout:
    """The layout a ParMLP stamp found under state_dict ``key`` records; the one reader of
    stamps (ParMLP's load, convert_checkpoint and the Megatron adapter), so that none reads
    a stamp another would refuse."""
    if not isinstance(raw, dict) or set(raw) != {STAMP_FIELD}:
        raise ValueError(
            f"{key}: unrecognised fc1 layout stamp {raw!r}; expected "
            "{'fc1_layout': {'kind': ..., 'chunk': ..., 'tp': ...}}"
        )
    return Layout.from_dict(raw[STAMP_FIELD], f"{key} {STAMP_FIELD}")


CANONICAL = Layout()


def packed_order(rows: int, chunk: int, tp: int = 1) -> torch.Tensor:
    """Index such that ``packed = canonical[index]`` for a [rows, ...] fc1 tensor.

    ``canonical`` is the global [W_gate; W_up]; TP rank r owns gate and up rows
    [r*F/tp, (r+1)*F/tp) of each half and packs them on its own.
    """
    if rows % 2:
        raise ValueError(f"fc1 has {rows} rows; a gated layer needs an even number")
    ffn = rows // 2
    if ffn % tp:
        raise ValueError(f"ffn size {ffn} is not divisible by tp={tp}")
    local = ffn // tp
    if local % chunk:
        raise ValueError(f"per-rank ffn size {local} is not divisible by chunk={chunk}")
    r = torch.arange(tp).view(tp, 1, 1, 1)
    c = torch.arange(local // chunk).view(1, -1, 1, 1)
    half = torch.arange(2).view(1, 1, 2, 1)  # 0: gate, 1: up
    t = torch.arange(chunk).view(1, 1, 1, chunk)
    return (half * ffn + r * local + c * chunk + t).flatten()


def order(rows: int, source: Layout, target: Layout) -> torch.Tensor | None:
    """Index with ``target_tensor = source_tensor[index]``; None when the layouts are equal."""
    if source == target:
        return None
    index = torch.arange(rows)
    if source.packed:  # undo: canonical[packed_order] = packed
        index = torch.empty_like(index).scatter_(
            0, packed_order(rows, source.chunk, source.tp), index
        )
    if target.packed:
        index = index[packed_order(rows, target.chunk, target.tp)]
    return index


def permute_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[index]`` along dim 0, for a DTensor too (FSDP2's sharded parameters and
    state_dicts): a pair may cross shards, so the rows are gathered, permuted and sharded again
    as they were."""
    index = index.to(tensor.device)
    if DTensor is None or not isinstance(tensor, DTensor):
        return tensor.index_select(0, index)
    full = tensor.full_tensor().index_select(0, index)  # every rank holds the same full rows
    return distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)


def relayout(tensor: torch.Tensor, source: Layout, target: Layout) -> torch.Tensor:
    """An fc1 weight, bias or per-element state moved from one layout to another (a copy)."""
    index = order(tensor.shape[0], source, target)
    return tensor.clone() if index is None else permute_rows(tensor, index)
