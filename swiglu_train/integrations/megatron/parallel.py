"""How ParMLPMegatron sits in Megatron's parallelism: which TP group it gets, the collectives
around its local math, and the data-parallel hooks of the linears it never calls.

Process groups: the TP group is the model's, never a guess. A TransformerLayer hands its
``pg_collection.tp`` to the stock ``MLP`` only (0.16-0.17 test ``spec.module == MLP``; 0.18+ call
``as_mlp_submodule`` with the collection, rewrapping a ModuleSpec of ``MLP``), so our classes
compare equal to ``MLP`` (:class:`MLPDispatch`) and take the stock path on every version. Built
with no group at all, the MLP takes ``parallel_state``'s global TP group as the stock MLP does,
and is refused where there is none (:func:`resolve_tp_group`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP


class MLPDispatch(type(MLP)):
    """Metaclass under which our MLP classes compare equal to Megatron's ``MLP``.

    megatron-core 0.16-0.17's TransformerLayer passes its model's TP group to the mlp submodule
    only when ``spec.module == MLP``; any other class is built on no group (and logged as
    "Unknown MLP type ... Using default kwargs"), so a model with its own ProcessGroupCollection
    got an MLP on the global group, or none. 0.18+ rewrap a ModuleSpec whose module is in
    ``(MLP, TEFusedMLP)`` into ``module.as_mlp_submodule`` with the collection. Equal to ``MLP``,
    a ModuleSpec of our class takes the stock MLP's path, groups included, on every version.
    Hashing and ``isinstance``/``issubclass`` stay those of a plain class.
    """

    def __eq__(cls, other: object) -> bool:
        return other is MLP or super().__eq__(other)

    __hash__ = type.__hash__


def resolve_tp_group(
    tp_group: torch.distributed.ProcessGroup | None,
    pg_collection: Any | None,
    owner: str,
    needs_group: bool = True,
) -> torch.distributed.ProcessGroup | None:
    """The TP group this MLP shards and reduces over: the one it was given, never a guess.

    Given a ``pg_collection`` (megatron-core 0.18+ TransformerLayers pass the model's) or a
    ``tp_group`` (0.16-0.17 pass ``pg_collection.tp``), that group; both must agree. Given
    neither, ``parallel_state``'s global TP group, as the stock MLP takes. With no
    ``parallel_state`` either, the model may well have groups of its own that did not reach us:
    refused rather than built unsharded or on the wrong ranks. Only a single process without
    torch.distributed and Megatron's own linears (``needs_group=False``) runs without a group.
    """
    if pg_collection is not None:
        if getattr(pg_collection, "tp", None) is None:
            raise ValueError(f"{owner}: pg_collection has no tp group; set pg_collection.tp")
        if tp_group is not None and tp_group is not pg_collection.tp:
            raise ValueError(
                f"{owner}: tp_group (ranks {_ranks(tp_group)}) and pg_collection.tp (ranks "
                f"{_ranks(pg_collection.tp)}) are different groups; pass one of them"
            )
        return pg_collection.tp
    if tp_group is not None:
        return tp_group
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    if needs_group or torch.distributed.is_initialized():
        raise ValueError(
            f"{owner} got no TP process group and megatron.core.parallel_state is not "
            "initialized, so it cannot know which ranks share its weights: pass tp_group= or "
            "pg_collection= (TransformerLayer and GPTModel(pg_collection=...) pass the model's), "
            "or call parallel_state.initialize_model_parallel for the global groups"
        )
    return None


def _ranks(group: torch.distributed.ProcessGroup) -> list[int]:
    return torch.distributed.get_process_group_ranks(group)


def to_tp_region(
    x: torch.Tensor, sequence_parallel: bool, group: torch.distributed.ProcessGroup | None
) -> torch.Tensor:
    """What ColumnParallelLinear does to its input: backward all-reduces (or
    reduce-scatters, with sequence parallelism) the input gradient over TP."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=True, group=group
        )
    return copy_to_tensor_model_parallel_region(x, group=group)


def from_tp_region(
    y: torch.Tensor, sequence_parallel: bool, group: torch.distributed.ProcessGroup | None
) -> torch.Tensor:
    """What RowParallelLinear does to its partial sums."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(y, group=group)
    return reduce_from_tensor_model_parallel_region(y, group=group)


def run_forward_pre_hooks(linear: torch.nn.Module, hidden_states: torch.Tensor) -> None:
    """Run ``linear``'s forward pre-hooks, as calling it would: our forward reads its weights
    without calling it, and Megatron's DDP waits for those weights' all-gather in such a hook
    (``overlap_param_gather``); skipped, a step reads stale weights or breaks its next gather.

    Each hook gets the MLP's input (fc2's own input never exists outside our kernels); a hook
    that rewrites the input cannot be honoured and is refused.
    """
    for hook_id, hook in linear._forward_pre_hooks.items():
        if hook_id in linear._forward_pre_hooks_with_kwargs:
            result = hook(linear, (hidden_states,), {})
        else:
            result = hook(linear, (hidden_states,))
        if result is not None:
            raise RuntimeError(
                f"a forward pre-hook on {type(linear).__name__} ({hook!r}) returned a new input; "
                "ParMLPMegatron runs its own GEMMs and never passes input through the linear"
            )
