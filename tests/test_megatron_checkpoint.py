"""dist-ckpt interchange: a GPTModel trained one Adam step at TP=2 and saved with Megatron's
optimizer state loads at TP=1 into the stock MLP and into every impl (save_factors' packed fc1
in both directions), and the resumed run's next Adam step gives the loss the saving run got.

Megatron's optimizers reuse the model's fc1 ShardedTensorFactory for Adam's moments; one Adam
step at a small lr barely moves the loss, so the loaded moments are compared directly too.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import rel_err
from megatron_support import make_optimizer, megatron_parallel, spawn, swiglu_config
from test_megatron_mlp import BATCH, PARITY, SEQ, VOCAB, build_gpt, gpt_loss

from megatron.core import dist_checkpointing  # isort: skip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # isort: skip
from megatron.core.optimizer.optimizer import FP32Optimizer  # isort: skip

from swiglu_train.integrations.megatron import get_gpt_layer_spec
from swiglu_train.layers import PORTABLE_IMPLS  # CPU-runnable: drop_h_quack needs CUDA
from swiglu_train.layers.layout import CANONICAL, relayout

KINDS = ("stock", *PORTABLE_IMPLS)
FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


def layer_spec(kind: str):
    if kind == "stock":
        return get_gpt_layer_local_spec(normalization="RMSNorm")
    return get_gpt_layer_spec(kind)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def train_step(model, optimizer: FP32Optimizer, step: int) -> None:
    optimizer.zero_grad()
    gpt_loss(model, batch(step)).backward()
    optimizer.step()


def checkpoint(model, optimizer: FP32Optimizer, is_loading: bool = False) -> dict:
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading)
    return state


def fc1_moments(model, optimizer: FP32Optimizer) -> dict[str, torch.Tensor]:
    """Adam's moments of every fc1 weight, a packed one's unpacked to canonical."""
    out = {}
    for name, mlp in model.named_modules():
        if name.endswith(".mlp"):
            state = optimizer.optimizer.state[mlp.linear_fc1.weight]
            layout = getattr(mlp, "fc1_layout", CANONICAL)
            for moment in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{moment}"] = relayout(state[moment], layout, CANONICAL)
    return out


def _save_worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    """One Adam step at TP=2, save, then record the loss after the following step."""
    with megatron_parallel(rank, world_size, rendezvous, tp=world_size):
        for kind in KINDS:
            model = build_gpt(swiglu_config(), layer_spec(kind), seed=0)
            optimizer = make_optimizer(model)
            train_step(model, optimizer, 0)
            directory = Path(root, kind)
            directory.mkdir(exist_ok=True)
            dist_checkpointing.save(checkpoint(model, optimizer), str(directory))
            train_step(model, optimizer, 1)
            with torch.no_grad():
                next_loss = gpt_loss(model, batch(2))
            if rank == 0:
                torch.save(next_loss, directory / "next_loss.pt")


def _load_worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous, tp=world_size):
        reference = None  # the stock run's moments, loaded into the stock MLP
        for saved in KINDS:
            directory = Path(root, saved)
            expected = torch.load(directory / "next_loss.pt")
            for kind in KINDS:
                model = build_gpt(swiglu_config(), layer_spec(kind), seed=1)
                optimizer = make_optimizer(model)
                state = dist_checkpointing.load(checkpoint(model, optimizer, True), str(directory))
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                moments = fc1_moments(model, optimizer)
                reference = reference or moments
                assert len(moments) == 4, sorted(moments)  # 2 layers x 2 moments
                for key, value in moments.items():
                    err = rel_err(value, reference[key])
                    assert err <= PARITY, f"TP2 {saved} -> TP1 {kind}: {key} off by {err:.2e}"
                train_step(model, optimizer, 1)
                with torch.no_grad():
                    loss = gpt_loss(model, batch(2))
                err = rel_err(loss, expected)
                assert err <= PARITY, f"TP2 {saved} -> TP1 {kind}: next loss off by {err:.2e}"
        _packed_refusals()


def _packed_refusals() -> None:
    """Where a packed fc1 cannot be written canonically, saving says so."""
    model = build_gpt(swiglu_config(), layer_spec("save_factors"), seed=1)
    for sharding in ("dp_reshardable", "dp_zero_gather_scatter"):
        metadata = {"distrib_optim_sharding_type": sharding}
        with pytest.raises(ValueError, match=f"format '{sharding}' writes optimizer state as"):
            model.sharded_state_dict(metadata=metadata)
        build_gpt(swiglu_config(), layer_spec("drop_h"), seed=1).sharded_state_dict(
            metadata=metadata
        )  # canonical impls store the same buffers as stock: allowed
    factory = model.sharded_state_dict()[FC1]
    flat = replace(factory, data=factory.data.flatten()[:8], flattened_range=slice(0, 8))
    with pytest.raises(NotImplementedError, match="flattened slice of a packed fc1"):
        flat.build()
    chunk = model.decoder.layers[0].mlp.fc1_layout.chunk
    pair = replace(factory, data=factory.data[: 2 * chunk])  # a slice, as FSDP shards fc1
    with pytest.raises(NotImplementedError, match=r"of this rank's \d+ packed fc1 rows"):
        pair.build()  # one [gate; up] pair of chunks: it would unpack as if it were all


@pytest.mark.slow
def test_dist_ckpt_reshards_tp2_to_tp1_across_impls(tmp_path: Path) -> None:
    spawn(_save_worker, 2, str(tmp_path))
    spawn(_load_worker, 1, str(tmp_path))
