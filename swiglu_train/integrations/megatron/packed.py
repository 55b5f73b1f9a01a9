"""A packed fc1 inside Megatron: this rank's ``linear_fc1`` shard lives in
``Layout("packed", C)`` while every checkpoint stays canonical.

dist-ckpt
    Megatron's stock MLP writes a gated fc1 through a ``ShardedTensorFactory``
    (``apply_swiglu_sharded_factory``) that splits the local [gate_r; up_r] into the global
    [W_gate; W_up]. :func:`packed_factory` wraps that factory: build unpacks the local tensor
    before the stock split, merge repacks what the stock merge loaded. Megatron's optimizers
    (the plain ones, and DistributedOptimizer's ``fully_reshardable`` format) reuse the
    model's factories with their own tensors, ``replace(factory, key=..., data=state)``, so
    Adam moments and fp32 master weights go through the same unpacking.

    DistributedOptimizer's ``dp_reshardable`` and ``dp_zero_gather_scatter`` formats bypass
    the factories and write its flat buffers as they sit in memory: a packed fc1's state
    would be stored packed and read, permuted, by any canonical model. They are refused.

plain ``state_dict``
    Packed state carries the ParMLP layout stamp under ``_extra_state`` (the stock MLP refuses
    that key in a strict load); loading converts stamped or canonical state into the module's
    layout, and refuses a stamp it cannot read. A Megatron state_dict holds this rank's shard,
    so its stamp describes the shard alone (``tp=1``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory

from swiglu_train.layers.layout import CANONICAL, Layout, order, read_stamp, relayout
from swiglu_train.layers.par_mlp import STAMP_KEY

FC1_PARAMS = ("linear_fc1.weight", "linear_fc1.bias")
# DistributedOptimizer formats that store its flat buffers without the model's factories.
BUFFER_FORMATS = frozenset({"dp_reshardable", "dp_zero_gather_scatter"})


def packed_factory(factory: Any, layout: Layout, rows: int) -> ShardedTensorFactory:
    """The stock fc1 factory, reading and writing a local tensor packed in ``layout``.

    ``rows`` is the local fc1's row count: the packing permutes whole rows of this rank's shard,
    so a tensor holding part of them (a data-parallel slice, as FSDP shards it) is refused
    rather than permuted as if it were the shard.
    """
    if not isinstance(factory, ShardedTensorFactory):
        raise TypeError(
            f"expected Megatron's SwiGLU ShardedTensorFactory for fc1, got {type(factory)}; "
            "this megatron-core version writes gated fc1 differently, so a packed fc1 cannot "
            "be checkpointed canonically here (use a canonical impl: normal or drop_h)"
        )
    build, merge = factory.build_fn, factory.merge_fn

    def build_fn(key: str, t: torch.Tensor, replica_id: Any, flattened_range: slice | None):
        if flattened_range is not None:
            raise NotImplementedError(
                f"{key}: a flattened slice of a packed fc1 (DistributedOptimizer "
                "'fully_sharded_model_space') cannot be unpacked; save with "
                "metadata={'distrib_optim_sharding_type': 'fully_reshardable'}"
            )
        if t.shape[0] != rows:
            raise NotImplementedError(
                f"{key}: {t.shape[0]} of this rank's {rows} packed fc1 rows (a data-parallel "
                "slice, as FSDP shards it) cannot be unpacked alone; save the whole TP shard, "
                "or use a canonical impl (normal, drop_h)"
            )
        return build(key, relayout(t, layout, CANONICAL), replica_id, flattened_range)

    def merge_fn(sub_state_dict: Any) -> torch.Tensor:
        return relayout(merge(sub_state_dict), CANONICAL, layout)

    return replace(factory, build_fn=build_fn, merge_fn=merge_fn)


def pack_sharded_state_dict(
    sharded_state_dict: dict, prefix: str, layout: Layout, rows: int, metadata: Mapping | None
) -> None:
    """Wrap the fc1 factories of a stock MLP's sharded state dict in place, and add the layout
    stamp as a non-persistent entry: the loaded state dict is then already packed, and says so
    to :func:`convert_on_load`, while the files hold exactly what the stock MLP writes."""
    sharding = (metadata or {}).get("distrib_optim_sharding_type")
    if sharding in BUFFER_FORMATS:
        raise ValueError(
            f"DistributedOptimizer format {sharding!r} writes optimizer state as it sits in "
            f"memory, where this MLP's fc1 is {layout}: the stock MLP or another impl would "
            "read its fc1 optimizer state permuted. Use metadata={'distrib_optim_sharding_type'"
            ": 'fully_reshardable'} (Megatron-LM: --dist-ckpt-optim-fully-reshardable), which "
            "goes through the model's unpacking factories"
        )
    for name in FC1_PARAMS:
        key = prefix + name
        if key in sharded_state_dict:
            sharded_state_dict[key] = packed_factory(sharded_state_dict[key], layout, rows)
    sharded_state_dict[prefix + STAMP_KEY] = LocalNonpersistentObject(stamp(layout))


def stamp(layout: Layout) -> dict:
    """The ParMLP stamp format: ``{"fc1_layout": {"kind", "chunk", "tp"}}``."""
    return {"fc1_layout": layout.to_dict()}


def stamp_packed(module: Any, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict hook: packed state carries its layout; canonical state carries none."""
    if module.fc1_layout.packed:
        state_dict[prefix + STAMP_KEY] = stamp(module.fc1_layout)


def convert_on_load(module: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: move incoming fc1 weight and bias into the module's layout.

    Unstamped state is canonical (stock Megatron's); a stamp must be one this code wrote.
    """
    raw = state_dict.pop(prefix + STAMP_KEY, None)
    source = CANONICAL if raw is None else read_stamp(raw, prefix + STAMP_KEY)
    if source == module.fc1_layout:
        return
    for name in FC1_PARAMS:
        key = prefix + name
        if key in state_dict:
            tensor = state_dict[key]
            _check_shape(key, tensor, getattr(module.linear_fc1, name.partition(".")[2]))
            index = order(tensor.shape[0], source, module.fc1_layout)
            state_dict[key] = tensor.index_select(0, index.to(tensor.device))


def _check_shape(key: str, tensor: torch.Tensor, param: torch.Tensor | None) -> None:
    """Refuse an incoming fc1 tensor whose shape is not this rank's before permuting its rows
    (a wrong size surfaced as a chunk that does not divide it, or permuted the wrong rows)."""
    if param is not None and tensor.shape != param.shape:
        raise ValueError(
            f"{key}: the state_dict holds shape {tuple(tensor.shape)}, this module's parameter "
            f"is {tuple(param.shape)} (this rank's shard: check ffn_hidden_size, hidden_size "
            "and the TP size the state_dict was saved at)"
        )
