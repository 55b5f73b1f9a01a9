"""Four gloo ranks on CPU, the layouts users outgrow one GPU with: a GPTModel with our spec (and
with Megatron's stock MLP) at TP=4 and at TP=2 x DP=2 against TP=1 from one initialization, and
a packed dist-ckpt written at TP=4 read back at TP=1 and TP=2 by canonical models; and the
MoE experts' four-rank parity against SequentialMLP (EP=2 with expert-TP=2, at TP=1 and TP=2:
``four_rank_parity`` of tests/test_megatron_moe.py, which has the two-rank layouts).

One spawn of four processes runs every case (start-up and imports dominate the time):
- per layout and kind: every rank's fc1 holds 2F/tp rows; the DP-averaged loss and every grad,
  gathered over TP (fc1 by Megatron's stride-2 [gate_r; up_r] rule), match TP=1 to 1e-5 in fp32,
  with Megatron's DistributedDataParallel averaging the grads over DP;
- save_factors trained one Adam step at TP=4 and saved with its optimizer: drop_h and stock
  load it at TP=1 and TP=2 with the same loss, the same (gathered) fc1 Adam moments, and
  the next step's loss the saving run got.

The workers run the activations in plain torch (``use_backend("torch")``): the subject here is
sharding, layouts and collectives, and the kernels, tested under the Triton interpreter
elsewhere, would take most of the time there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import rel_err
from megatron_support import make_optimizer, shim_cuda_only_calls, spawn, swiglu_config
from test_megatron_checkpoint import batch, checkpoint, fc1_moments, layer_spec, train_step
from test_megatron_mlp import PARITY, SEQ, VOCAB, build_gpt, gpt_loss
from test_megatron_moe import four_rank_parity

from megatron.core import dist_checkpointing, parallel_state  # isort: skip
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # isort: skip

from swiglu_train.integrations.megatron import ParMLPMegatron
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops.activation import use_backend

WORLD = 4
TP_SIZES = (4, 2)  # TP=4 x DP=1 and TP=2 x DP=2
# One canonical and one packed impl beside stock: normal shards exactly as drop_h does (the same
# canonical fc1; they differ in what they save, which tests/test_megatron_mlp.py covers at TP=2)
KINDS = ("stock", "drop_h", "save_factors")
CANONICAL_KINDS = ("stock", "drop_h")
GLOBAL_BATCH = 4  # split over DP ranks: 2 sequences each at DP=2


@contextlib.contextmanager
def model_parallel(tp: int) -> Iterator[None]:
    """parallel_state at TP ``tp`` over the four ranks (DP = 4 / tp), with the CPU shims."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        shim_cuda_only_calls()  # after: initialize refuses a memory buffer already set
        yield
    finally:
        parallel_state.destroy_model_parallel()


def gather_tp(local: torch.Tensor, dim: int, stride: int) -> torch.Tensor:
    """The full tensor of a TP-sharded one, inverting Megatron's CPU-init split: the master is cut
    into tp*stride blocks along ``dim`` and rank r holds blocks r, r + tp, ... in order."""
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(pieces, local.contiguous(), group=group)
    blocks = [piece.chunk(stride, dim) for piece in pieces]
    return torch.cat([rank[k] for k in range(stride) for rank in blocks], dim)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's grad as TP=1 holds it: Megatron DDP's main_grad where there is one,
    a packed fc1's unpacked to canonical, TP shards gathered."""
    layouts = {
        f"{name}.linear_fc1.weight": mlp.fc1_layout
        for name, mlp in model.named_modules()
        if isinstance(mlp, ParMLPMegatron)
    }
    out = {}
    for name, p in model.named_parameters():
        grad = p.main_grad if hasattr(p, "main_grad") else p.grad
        grad = relayout(grad, layouts.get(name, CANONICAL), CANONICAL)
        if getattr(p, "tensor_model_parallel", False):
            grad = gather_tp(grad, p.partition_dim, p.partition_stride)
        out[name.removeprefix("module.")] = grad
    return out


def reference(kind: str, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """TP=1 (each rank its own copy, no collective): loss and grads on the whole batch."""
    with model_parallel(1):
        model = build_gpt(swiglu_config(), layer_spec(kind), seed=0)
        loss = gpt_loss(model, tokens)
        loss.backward()
        return {"loss": loss.detach(), **full_grads(model)}


def sharded(kind: str, tp: int, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same model at TP ``tp`` under Megatron's DDP: each DP rank its slice of the batch."""
    with model_parallel(tp):
        config = swiglu_config()
        model = build_gpt(config, layer_spec(kind), seed=0)
        rows = 2 * config.ffn_hidden_size // tp
        for layer in model.decoder.layers:
            shape = tuple(layer.mlp.linear_fc1.weight.shape)
            assert shape == (rows, config.hidden_size), f"{kind} tp={tp}: fc1 {shape}"
        ddp = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(), module=model
        )
        dp_group = parallel_state.get_data_parallel_group()
        local = tokens.chunk(dp_group.size())[parallel_state.get_data_parallel_rank()]
        loss = gpt_loss(ddp, local)
        loss.backward()
        ddp.finish_grad_sync()  # averages the grads over DP
        loss = loss.detach()
        dist.all_reduce(loss, group=dp_group)  # equal token counts: the mean of the means
        return {"loss": loss / dp_group.size(), **full_grads(ddp)}


def _tp_parity() -> None:
    tokens = torch.randint(
        0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3)
    )
    stock = reference("stock", tokens)
    for kind in KINDS:
        expected = reference(kind, tokens)
        err = rel_err(expected["loss"], stock["loss"])
        assert err <= PARITY, f"TP=1 {kind}: loss off stock by {err:.2e}"  # one init, every kind
        for tp in TP_SIZES:
            label = f"{kind} TP={tp} x DP={WORLD // tp}"
            got = sharded(kind, tp, tokens)
            assert got.keys() == expected.keys(), label
            for name, value in expected.items():
                err = rel_err(got[name], value)
                assert err <= PARITY, f"{label}: {name} off TP=1 by {err:.2e}"


def fc1_full_moments(model, optimizer) -> dict[str, torch.Tensor]:
    """fc1's Adam moments, canonical and gathered over TP (stride 2, like the weight)."""
    return {k: gather_tp(v, 0, 2) for k, v in fc1_moments(model, optimizer).items()}


def _packed_tp4_checkpoint(root: str) -> None:
    with model_parallel(4):
        model = build_gpt(swiglu_config(), layer_spec("save_factors"), seed=0)
        assert model.decoder.layers[0].mlp.fc1_layout.kind == "packed"
        optimizer = make_optimizer(model)
        train_step(model, optimizer, 0)
        dist_checkpointing.save(checkpoint(model, optimizer), root)
        moments = fc1_full_moments(model, optimizer)
        with torch.no_grad():
            saved_loss = gpt_loss(model, batch(1))
        train_step(model, optimizer, 1)
        with torch.no_grad():
            next_loss = gpt_loss(model, batch(2))
    for tp in (1, 2):
        with model_parallel(tp):
            for kind in CANONICAL_KINDS:
                label = f"save_factors TP=4 -> {kind} TP={tp}"
                model = build_gpt(swiglu_config(), layer_spec(kind), seed=1)
                optimizer = make_optimizer(model)
                state = dist_checkpointing.load(checkpoint(model, optimizer, True), root)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                with torch.no_grad():
                    err = rel_err(gpt_loss(model, batch(1)), saved_loss)
                assert err <= PARITY, f"{label}: loss off by {err:.2e}"
                loaded = fc1_full_moments(model, optimizer)
                assert loaded.keys() == moments.keys(), label
                for key, value in moments.items():
                    err = rel_err(loaded[key], value)
                    assert err <= PARITY, f"{label}: {key} off by {err:.2e}"
                train_step(model, optimizer, 1)
                with torch.no_grad():
                    err = rel_err(gpt_loss(model, batch(2)), next_loss)
                assert err <= PARITY, f"{label}: next step's loss off by {err:.2e}"


def _worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
    )
    try:
        with use_backend("torch"):  # see the module docstring
            _tp_parity()
            _packed_tp4_checkpoint(root)
            four_rank_parity()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tp4_and_tp2_dp2_match_tp1_and_reshard_a_packed_checkpoint(tmp_path: Path) -> None:
    """And the MoE experts match SequentialMLP at EP=2 x expert-TP=2 (one spawn for both)."""
    spawn(_worker, WORLD, str(tmp_path))
