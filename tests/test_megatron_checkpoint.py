"""dist-ckpt interchange: a GPTModel saved at TP=2 loads at TP=1 into the stock MLP and into
every impl, and the resumed model's next loss is the one the saving run computed."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import rel_err
from megatron_support import megatron_parallel, spawn, swiglu_config
from test_megatron_mlp import BATCH, PARITY, SEQ, VOCAB, build_gpt, gpt_loss

from megatron.core import dist_checkpointing  # isort: skip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # isort: skip

from swiglu_train.integrations.megatron import SUPPORTED_IMPLS, get_gpt_layer_spec

KINDS = ("stock", *SUPPORTED_IMPLS)


def layer_spec(kind: str):
    if kind == "stock":
        return get_gpt_layer_local_spec(normalization="RMSNorm")
    return get_gpt_layer_spec(kind)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _save_worker(rank: int, world_size: int, port: int, root: str) -> None:
    """Train one SGD step at TP=2, save, and record the loss of the step that would follow."""
    with megatron_parallel(rank, world_size, port, tp=world_size):
        for kind in KINDS:
            model = build_gpt(swiglu_config(), layer_spec(kind), seed=0)
            gpt_loss(model, batch(0)).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                next_loss = gpt_loss(model, batch(1))
            directory = Path(root, kind)
            directory.mkdir(exist_ok=True)
            dist_checkpointing.save(model.sharded_state_dict(), str(directory))
            if rank == 0:
                torch.save(next_loss, directory / "next_loss.pt")


def _load_worker(rank: int, world_size: int, port: int, root: str) -> None:
    with megatron_parallel(rank, world_size, port, tp=world_size):
        for saved in KINDS:
            directory = Path(root, saved)
            expected = torch.load(directory / "next_loss.pt")
            for kind in KINDS:
                model = build_gpt(swiglu_config(), layer_spec(kind), seed=1)
                state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
                model.load_state_dict(state)
                loss = gpt_loss(model, batch(1))
                err = rel_err(loss.detach(), expected)
                assert err <= PARITY, f"TP2 {saved} -> TP1 {kind}: next loss off by {err:.2e}"
                loss.backward()  # the resumed model trains


def test_dist_ckpt_reshards_tp2_to_tp1_across_impls(tmp_path: Path) -> None:
    spawn(_save_worker, 2, str(tmp_path))
    spawn(_load_worker, 1, str(tmp_path))
