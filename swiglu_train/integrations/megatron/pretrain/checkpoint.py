"""dist-ckpt save and resume of the model and its optimizer (``--save``, ``--load``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer


def checkpoint_state(model: DistributedDataParallel, optimizer, is_loading: bool = False) -> dict:
    """Model and optimizer sharded state; DDP adds no keys of its own.

    DistributedOptimizer state goes in model space through the model's ShardedTensorFactories
    ('fully_reshardable'): it reshards across TP/PP/DP, and a packed fc1 (save_factors) is
    written canonical. megatron-core 0.16's default format no longer saves, and the 'dp_*'
    formats write the flat buffers as they sit in memory, refused for a packed fc1. A fresh
    dict per call: Megatron adds its process groups to the metadata in place.
    """
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    state = {"model": model.module.sharded_state_dict(metadata=metadata)}
    if isinstance(optimizer, MegatronOptimizer):
        state["optimizer"] = optimizer.sharded_state_dict(
            state["model"], is_loading, metadata=metadata
        )
    return state


def save(root: str, step: int, model, optimizer) -> None:
    """Write ``ROOT/iter_{step:07d}``, which ``--load`` takes to resume at ``step``."""
    directory = os.path.join(root, f"iter_{step:07d}")
    os.makedirs(directory, exist_ok=True)
    state = checkpoint_state(model, optimizer) | {"step": step}
    dist_checkpointing.save(state, directory)


@contextlib.contextmanager
def loadable(optimizer: MegatronOptimizer) -> Iterator[None]:
    """A fresh optimizer made able to load a checkpoint where Megatron runs torch's Adam (no
    Apex or TE, as on our machines). Three megatron-core 0.16 gaps, met resuming on the H200:
    - DistributedOptimizer.state_dict reads one common 'step' off the param states, which a
      fresh Adam lacks: it gets zero moments and step 0 (what a fresh Adam starts from; the
      load overwrites both);
    - its fully-reshardable param load copies every per-param state key from the checkpoint,
      'step' included, which that format keeps per group: the per-param steps step aside
      while it runs and come back after (already set from the checkpoint's group step);
    - it hands every param the same 'step' tensor, which torch's Adam then bumps once per param
      per step (bias correction as if at step 3 + n_params, a 0.7 % loss jump on the H200):
      each param gets its own copy after the load.
    """
    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.init_state_fn is None:
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for state in opt.optimizer.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
        load_params = getattr(opt, "load_parameter_state_from_fully_reshardable", None)
        if load_params is not None:
            opt.load_parameter_state_from_fully_reshardable = _steps_aside(opt, load_params)
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:  # the instance attribute goes; the class's method serves again
            del opt.load_parameter_state_from_fully_reshardable
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def _steps_aside(opt: MegatronOptimizer, load_params: Callable[[dict], None]):
    def load_without_step(param_state: dict) -> None:
        state = opt.optimizer.state
        steps = {p: s.pop("step") for p, s in state.items() if "step" in s}
        try:
            load_params(param_state)
        finally:
            for p, step in steps.items():
                state[p]["step"] = step

    return load_without_step


def load(directory: str, model, optimizer) -> int:
    megatron = isinstance(optimizer, MegatronOptimizer)
    with loadable(optimizer) if megatron else contextlib.nullcontext():
        state = dist_checkpointing.load(checkpoint_state(model, optimizer, True), directory)
        model.module.load_state_dict(state["model"])
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
    return dist_checkpointing.load_common_state_dict(directory)["step"]
