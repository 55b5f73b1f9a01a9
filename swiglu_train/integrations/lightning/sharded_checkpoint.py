"""Sharded checkpoints, as ``--strategy fsdp2`` writes them: a directory that
``torch.distributed.checkpoint`` wrote (a ``.metadata`` index and one ``.distcp`` file per rank,
holding the weights and optimizer state) with Lightning's ``meta.pt`` (all the rest: step,
loops, hyper-parameters, our ``swiglu_train`` record).

``--resume`` reads ``meta.pt`` and the index alone; the weights load shard by shard inside
Lightning, at any world size. What needs the whole model (export-hf, convert, --init-from,
consolidate) reads it through :func:`consolidate`, into the one-file format a single-device run
writes, so that each of them takes either.

Reading one unpickles: the index is a pickle, and so are non-tensor entries. The commands that
take ``--trust`` ask for it (TRUST).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from swiglu_train.integrations.lightning.checkpoint_record import LAYOUT_KEY

INDEX = ".metadata"  # torch.distributed.checkpoint's
META = "meta.pt"  # Lightning's (lightning.fabric.utilities.load._METADATA_FILENAME)
OPTIMIZER = re.compile(r"optimizer_(\d+)")  # ModelParallelStrategy's key of optimizer i's state
TRUST = ("is a sharded checkpoint, whose index torch.distributed.checkpoint pickles; pass "
         "--trust if you trust it")  # fmt: skip


def is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / INDEX).is_file()


def read_meta(path: Path, flag: str) -> dict:
    """``meta.pt`` of the sharded checkpoint at ``path``, with ``optimizer_states`` naming the
    optimizers whose state the shards hold (a list, empty where none), as the one-file
    checkpoint's list holds their states."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = _load_meta(path, flag)
    try:
        index = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # a damaged or cut .metadata: pickle, EOF or OS errors
        raise ValueError(f"{flag}: {path}/{INDEX} is not a readable shard index "
                         f"({type(e).__name__}: {e})") from e  # fmt: skip
    found = {key.split(".", 1)[0] for key in index}
    meta["optimizer_states"] = sorted(filter(OPTIMIZER.fullmatch, found), key=_position)
    return meta


def consolidate(path: Path, flag: str) -> dict:
    """The sharded checkpoint at ``path`` as one checkpoint in memory, in the format a
    single-device run saves: full tensors, and ``optimizer_states`` keyed by parameter index
    over the param groups, in order (FSDP2 keys them by parameter name). It must fit in CPU
    memory, as a one-file checkpoint of the same model does."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from torch.distributed.checkpoint.api import CheckpointException

    read_meta(path, flag)  # a missing or damaged meta.pt or index, named before the shards
    try:  # Lightning's reader of its own format, which needs no process group
        ckpt = _load_distributed_checkpoint(path)
    except (Exception, CheckpointException) as e:  # a damaged or missing shard (DCP's
        # CheckpointException is a BaseException)
        reason = _cause(e)
        raise ValueError(
            f"{flag}: {path} is a sharded checkpoint that cannot be read whole ({reason})"
        ) from e
    keys = sorted(filter(OPTIMIZER.fullmatch, ckpt), key=_position)
    names = ckpt.get(LAYOUT_KEY, {}).get("optimizer_param_names")
    ckpt["optimizer_states"] = [by_index(ckpt.pop(k), names if i == 0 else None, f"{flag}: {path}")
                                for i, k in enumerate(keys)]  # fmt: skip
    return ckpt


def by_index(optimizer: dict, names: list[list[str]] | None, where: str) -> dict:
    """An optimizer state keyed by parameter name (FSDP2's) keyed by index instead, as
    ``torch.optim.Optimizer.state_dict`` numbers them: through the param groups, in order.
    ``names``, the checkpoint's own record of each group's parameters, must agree: a state
    moved onto the wrong parameter would be read without error."""
    groups = optimizer["param_groups"]
    order = [list(g["params"]) for g in groups]
    if names is not None and order != names:
        raise ValueError(f"{where}: the optimizer's parameter order differs from the one the "
                         "checkpoint records (swiglu_train.optimizer_param_names)")  # fmt: skip
    index = {name: i for i, name in enumerate(n for group in order for n in group)}
    unknown = sorted(set(optimizer["state"]) - set(index))
    if unknown:
        raise ValueError(f"{where}: optimizer state for parameters in no param group: {unknown}")
    return {
        "state": {index[name]: state for name, state in optimizer["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


def by_name(optimizer: dict, names: list[list[str]] | None, where: str) -> dict:
    """:func:`by_index`'s inverse, for FSDP2 to load a one-file checkpoint's optimizer state:
    torch's index-keyed state keyed by the parameter names the checkpoint records for each
    param group (``names``; None where it records none, which is refused: no order of the
    model's parameters is sure to be the optimizer's)."""
    groups = optimizer["param_groups"]
    if names is None:
        raise ValueError(
            f"{where} records no optimizer parameter names (swiglu_train."
            "optimizer_param_names), which --strategy fsdp2 needs to place the optimizer "
            "state; resume it with the strategy that wrote it"
        )
    if [len(g["params"]) for g in groups] != [len(group) for group in names]:
        raise ValueError(f"{where}: the optimizer's param groups differ in size from the "
                         "parameter names the checkpoint records")  # fmt: skip
    name = {i: n for g, group in zip(groups, names, strict=True)
            for i, n in zip(g["params"], group, strict=True)}  # fmt: skip
    unknown = sorted(set(optimizer["state"]) - set(name))
    if unknown:
        raise ValueError(f"{where}: optimizer state for parameters in no param group: {unknown}")
    return {
        "state": {name[i]: state for i, state in optimizer["state"].items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in groups],
    }


def _cause(e: BaseException) -> str:
    """What failed, in one line: DCP's CheckpointException holds each rank's (exception,
    stack) and prints their tracebacks."""
    failures = getattr(e, "failures", None) or {0: e}
    causes = [c[0] if isinstance(c, tuple) else c for c in failures.values()]
    said = [(type(c).__name__, " ".join(str(c).split())) for c in causes]
    return "; ".join(f"{kind}: {text}" if text else kind for kind, text in said)[:300]


def _position(key: str) -> int:
    """i of ``optimizer_i``."""
    return int(OPTIMIZER.fullmatch(key).group(1))


def _load_meta(path: Path, flag: str) -> dict:
    file = path / META
    if not file.is_file():
        raise ValueError(f"{flag}: {path} holds shards but no {META} (Lightning writes it last): "
                         "an incomplete save; use an earlier checkpoint")  # fmt: skip
    try:
        meta = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # EOFError, UnpicklingError, RuntimeError... for a damaged file
        raise ValueError(f"{flag}: {file} is not readable ({type(e).__name__}: {e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{flag}: {file} holds a {type(meta).__name__}, not a checkpoint dict")
    return meta
