"""ParExpertsMegatron's checkpoints in Megatron ``SequentialMLP``'s keys and format, so either
loads the other's, through dist-ckpt at another EP or expert-TP size, or as a plain state_dict.

dist-ckpt
    SequentialMLP writes each expert's ``MLP`` with the global expert index as a prepended axis:
    ``{prefix}experts.linear_fc1.weight`` global [E, 2F, D] (the gated fc1 split into its gate
    and up halves, each sharded over expert TP, as ``apply_swiglu_sharded_factory`` does) and
    ``{prefix}experts.linear_fc2.weight`` [E, D, F] sharded over expert TP on F, each expert
    replicated over expert data parallelism; with ``metadata["singleton_local_shards"]`` one key
    per expert instead (``{prefix}experts.{e}.linear_fc1.weight_w`` and ``_v``, ...). Our stacked
    parameters are written through one ``ShardedTensorFactory`` each, whose build makes exactly
    those ShardedTensors from the expert slices and whose merge stacks them back, as Megatron's
    own GroupedMLP does. Megatron's optimizers reuse the factories for their states (the plain
    optimizers, and DistributedOptimizer's ``fully_reshardable`` format), so Adam's moments
    interchange too. The formats that write DistributedOptimizer's flat buffers as they sit in
    memory (``dp_reshardable``) hold our stacked tensors, not SequentialMLP's per-expert ones:
    they resume our model only; ``fully_sharded_model_space`` (per-parameter flat slices) is
    refused, as a slice of a stacked tensor is not a slice of any one expert.

plain ``state_dict``
    Saving writes SequentialMLP's keys (``local_experts.{i}.linear_fc1.weight``, its linears'
    empty ``_extra_state``); loading takes those keys, or our own, into the stacked parameters.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

PARAMS = {"fc1_weight": "linear_fc1", "fc2_weight": "linear_fc2"}
_LOCAL_KEY = re.compile(r"local_experts\.(\d+)\.(linear_fc[12])\.(weight|_extra_state)$")


def experts_sharded_state_dict(
    module: Any, prefix: str, sharded_offsets: tuple, metadata: dict | None
) -> dict:
    """The sharded state dict of a ParExpertsMegatron (the module docstring)."""
    singleton = bool((metadata or {}).get("singleton_local_shards", False))
    first, total = _expert_range(module)
    tp_rank, tp_size = get_pg_rank(module.tp_group), get_pg_size(module.tp_group)
    replica_id = (0, 0, get_pg_rank(module.dp_group))
    n = len(sharded_offsets)
    experts = range(first, first + module.num_local_experts)

    def expert_offsets(e: int) -> tuple:
        return tuple(sharded_offsets) if singleton else (*sharded_offsets, (n, e, total))

    def expert_key(key: str, e: int) -> str:
        return key.replace(f"{prefix}experts.", f"{prefix}experts.{e}.") if singleton else key

    def build(linear: str, key: str, t: torch.Tensor, replica: Any, flat: slice | None) -> list:
        if flat is not None:
            raise NotImplementedError(
                f"{key}: a flattened slice of stacked experts (DistributedOptimizer "
                "'fully_sharded_model_space') is not one expert's; save with "
                "metadata={'distrib_optim_sharding_type': 'fully_reshardable'}"
            )
        axis = n if singleton else n + 1  # the TP-split axis of fc1's rows / fc2's columns
        out = []
        for e, w in zip(experts, t, strict=True):
            offsets, k = expert_offsets(e), expert_key(key, e)
            if linear == "linear_fc2":
                split = (axis + 1, tp_rank, tp_size)
                out.append(_sharded(k, w, offsets, split, replica, axis))
                continue
            # fc1's [gate_r; up_r]: rows r and tp + r of 2 tp global blocks, or with singleton
            # shards one key per half, each split in tp blocks
            gate, up = w.chunk(2)
            if singleton:
                split = (axis, tp_rank, tp_size)
                halves = [(k + "_w", gate, split), (k + "_v", up, split)]
            else:
                split, size = (axis, tp_rank, 2 * tp_size), 2 * tp_size
                halves = [(k, gate, split), (k, up, (axis, tp_size + tp_rank, size))]
            out.append([_sharded(k_, h, offsets, s, replica, axis) for k_, h, s in halves])
        return out

    def merge(loaded: list) -> torch.Tensor:
        return torch.stack([torch.cat(x) if isinstance(x, list) else x for x in loaded])

    state: dict = {}
    for param, linear in PARAMS.items():
        state[prefix + param] = ShardedTensorFactory(
            f"{prefix}experts.{linear}.weight",
            getattr(module, param),
            lambda key, t, replica, flat, linear=linear: build(linear, key, t, replica, flat),
            merge,
            replica_id,
        )
        # the linears' (empty) extra state, which SequentialMLP reads back
        for i, e in enumerate(experts):
            state[f"{prefix}local_experts.{i}.{linear}._extra_state"] = (
                make_sharded_object_for_checkpoint(
                    None,
                    expert_key(f"{prefix}experts.{linear}._extra_state", e),
                    expert_offsets(e),
                    (0, tp_rank, replica_id[2]),
                )
            )
    return state


def _sharded(
    key: str, data: torch.Tensor, offsets: tuple, split: tuple, replica: Any, prepend: int
) -> ShardedTensor:
    """One expert's (half) weight: ``offsets`` place the expert, ``split`` its TP shard."""
    return ShardedTensor.from_rank_offsets(
        key, data, *offsets, split, replica_id=replica, prepend_axis_num=prepend
    )


def _expert_range(module: Any) -> tuple[int, int]:
    """(global index of this rank's first expert, experts over the EP group)."""
    ep_rank, ep_size = get_pg_rank(module.ep_group), get_pg_size(module.ep_group)
    return ep_rank * module.num_local_experts, ep_size * module.num_local_experts


def sequential_keys_on_save(module: Any, state_dict: dict, prefix: str, metadata: Any) -> None:
    """state_dict hook: the stacked parameters as SequentialMLP's per-expert keys (views)."""
    for param, linear in PARAMS.items():
        stacked = state_dict.pop(prefix + param)
        for i in range(module.num_local_experts):
            state_dict[f"{prefix}local_experts.{i}.{linear}.weight"] = stacked[i]
            state_dict[f"{prefix}local_experts.{i}.{linear}._extra_state"] = None


def sequential_keys_on_load(module: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: SequentialMLP's per-expert weights stacked into ours, their
    linears' extra state dropped. Incomplete sets are left as they are, for the strict load to
    name what is missing or unexpected."""
    found: dict[str, dict[int, str]] = {linear: {} for linear in PARAMS.values()}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _LOCAL_KEY.fullmatch(key[len(prefix) :])
        if match is None:
            continue
        index, linear, kind = match.groups()
        if kind == "_extra_state":
            del state_dict[key]
        else:
            found[linear][int(index)] = key
    for param, linear in PARAMS.items():
        keys = found[linear]
        if sorted(keys) == list(range(module.num_local_experts)):
            experts = [state_dict.pop(keys[i]) for i in sorted(keys)]
            state_dict[prefix + param] = torch.stack(experts)
