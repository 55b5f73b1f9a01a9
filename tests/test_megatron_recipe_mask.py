"""--no-create-attention-mask-in-dataloader: the same training without the per-sample masks.

On a GPU, Megatron's local attention builds its own causal mask when none is given
(``megatron.core.transformer.utils.get_default_causal_mask``, CUDA-only). The worker stands a
CPU copy of that function in for it (a shim, documented here), so the CPU run checks that the
recipe without the dataloader's masks trains exactly as with them.
"""

from __future__ import annotations

import pytest
import torch
from megatron_support import megatron_parallel, spawn
from test_megatron_recipe import TINY
from test_megatron_recipe_parity import build, train

from megatron.core.fusions import fused_softmax  # isort: skip

from swiglu_train.integrations.megatron.pretrain.args import parse_args
from swiglu_train.integrations.megatron.pretrain.data import train_loader
from swiglu_train.ops.activation import use_backend


def _causal_mask_on_cpu(sq: int) -> torch.Tensor:
    """Megatron's get_default_causal_mask, on the CPU."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _worker(rank: int, world_size: int, rendezvous: str) -> None:
    fused_softmax.get_default_causal_mask = _causal_mask_on_cpu
    with megatron_parallel(rank, world_size, rendezvous), use_backend("torch"):
        losses = {}
        for in_dataloader in (True, False):
            args, model, optimizer = build("drop_h", gpu_init=False)
            args.create_attention_mask_in_dataloader = in_dataloader  # past the CPU refusal
            batch = next(iter(train_loader(args)))
            assert ("attention_mask" in batch) is in_dataloader, sorted(batch)
            losses[in_dataloader] = train(args, model, optimizer, 3)
        assert len(set(losses[True])) == 3, losses  # it trained
        assert losses[False] == losses[True], losses  # the same masked scores, bit for bit


@pytest.mark.slow
def test_without_the_dataloader_s_masks_the_recipe_trains_the_same() -> None:
    spawn(_worker, 1)


def test_without_masks_needs_cuda(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([*TINY, "--no-create-attention-mask-in-dataloader"])
    err = capsys.readouterr().err
    assert "--no-create-attention-mask-in-dataloader needs --device cuda" in err
    assert parse_args(TINY).create_attention_mask_in_dataloader is True  # Megatron-LM's default
