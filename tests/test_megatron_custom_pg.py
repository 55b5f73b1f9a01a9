"""A GPTModel built with a caller-made ProcessGroupCollection (Megatron's own
``test_gpt_model_with_custom_pg``, on CPU gloo): our spec against the stock one.

Two ranks, four group setups: the model's TP 1 and TP 2, each with ``parallel_state`` left
uninitialized (how a user who manages their own groups builds) and initialized to the other TP
size (where a fallback to the global group would build fc1 on the wrong ranks). For every impl:
parameter shapes equal stock's, every MLP and its linears hold the collection's TP group,
logits, loss and grads match stock from the same weights, a canonical model's state_dict loads into
the stock model and computes the same loss, and Megatron logs no warning about our MLP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import rel_err
from megatron_support import shim_cuda_only_calls, spawn, swiglu_config
from test_megatron_mlp import BATCH, PARITY, SEQ, VOCAB, assert_parity, grads, stock_submodules

from megatron.core import parallel_state  # isort: skip
from megatron.core.models.gpt import GPTModel  # isort: skip
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # isort: skip
from megatron.core.process_groups_config import ProcessGroupCollection  # isort: skip
from megatron.core.transformer.mlp import MLP  # isort: skip
from megatron.core.transformer.spec_utils import ModuleSpec  # isort: skip

from swiglu_train.integrations.megatron import (
    ParMLPMegatron,
    SwiGLUActivationMLP,
    get_gpt_layer_spec,
)
from swiglu_train.integrations.megatron.specs import BUILDER_API
from swiglu_train.layers import PORTABLE_IMPLS
from swiglu_train.layers.registry import PACKED_IMPLS

WORLD = 2
# (the model's TP size, parallel_state's TP size or None where it is not initialized)
SETUPS = ((1, None), (2, None), (1, 2), (2, 1))
LAYER_LOGGER = "megatron.core.transformer.transformer_layer"


class _Records(logging.Handler):
    """Megatron's TransformerLayer warnings, kept to assert on their messages."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def collection(tp: int) -> ProcessGroupCollection:
    """The groups Megatron's test builds by hand (there with HyperCommGrid, which needs einops):
    TP over ``tp`` consecutive ranks, CP, EP and PP of one rank, DP over the rest."""

    def subgroup(size: int) -> dist.ProcessGroup:
        ranks = [list(range(first, first + size)) for first in range(0, WORLD, size)]
        return dist.new_subgroups_by_enumeration(ranks)[0]

    pp = subgroup(1)
    embd = dist.new_group(parallel_state.default_embedding_ranks(dist.get_process_group_ranks(pp)))
    return ProcessGroupCollection(tp=subgroup(tp), cp=subgroup(1), pp=pp, ep=subgroup(1), embd=embd)


def build_gpt(config, spec, seed: int, pg: ProcessGroupCollection) -> GPTModel:
    """A GPTModel on ``pg`` whose logits are gathered over its TP group: Megatron's
    vocab-parallel loss reads parallel_state's group, which such a model may not have."""
    torch.manual_seed(seed)  # CPU init draws the full master weight, then keeps this rank's rows
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        parallel_output=False,
        pg_collection=pg,
    )


def gpt_forward(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, s, vocab], whole on every rank; their next-token loss)."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    mask = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(1)[None, None]
    logits = model(tokens, positions, mask)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    return logits, loss


def _check_model_groups(model, pg: ProcessGroupCollection, tp: int, label: str) -> None:
    for layer in model.decoder.layers:
        mlp = layer.mlp
        assert isinstance(mlp, ParMLPMegatron), label
        for module in (mlp, mlp.linear_fc1, mlp.linear_fc2):
            assert module.tp_group is pg.tp, f"{label}: {type(module).__name__} tp_group"
        expected = 2 * mlp.config.ffn_hidden_size // tp
        assert mlp.linear_fc1.weight.shape[0] == expected, f"{label}: fc1 not sharded over TP"


def _setup(model_tp: int, global_tp: int | None, log: _Records) -> None:
    label = f"model tp={model_tp} parallel_state tp={global_tp}"
    pg = collection(model_tp)
    config = swiglu_config(tensor_model_parallel_size=model_tp)
    stock = build_gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"), 0, pg)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    stock_logits, stock_loss = gpt_forward(stock, tokens)
    stock_loss.backward()
    stock_shapes = {n: p.shape for n, p in stock.named_parameters()}
    for impl in PORTABLE_IMPLS:
        case = f"{label} impl={impl}"
        log.messages.clear()
        ours = build_gpt(config, get_gpt_layer_spec(impl), 1, pg)
        assert log.messages == [], f"{case}: Megatron warned {log.messages}"
        _check_model_groups(ours, pg, model_tp, case)
        assert {n: p.shape for n, p in ours.named_parameters()} == stock_shapes, case
        if impl not in PACKED_IMPLS:  # a packed state_dict is refused by stock, by design
            with torch.no_grad():
                fresh = gpt_forward(ours, tokens)[1]
            reloaded = build_gpt(config, get_gpt_layer_local_spec(normalization="RMSNorm"), 2, pg)
            reloaded.load_state_dict(ours.state_dict())  # strict
            with torch.no_grad():
                err = rel_err(gpt_forward(reloaded, tokens)[1], fresh)
            assert err <= PARITY, f"{case}: stock loading our state_dict is off by {err:.2e}"
        ours.load_state_dict(stock.state_dict())
        logits, loss = gpt_forward(ours, tokens)
        loss.backward()
        assert_parity(
            {"logits": logits.detach(), "loss": loss.detach(), **grads(ours)},
            {"logits": stock_logits.detach(), "loss": stock_loss.detach(), **grads(stock)},
            case,
        )


def _user_module_spec(log: _Records) -> None:
    """A layer spec naming our classes in a ModuleSpec, as a user's own spec does: built with the
    model's group on every version. 0.18+ rewrap it into ``as_mlp_submodule`` and log that (the
    check that the log capture works); 0.16-0.17 build it as the stock MLP, without a warning."""
    logged = {}
    for cls, impl in ((ParMLPMegatron, "drop_h"), (SwiGLUActivationMLP, "normal")):
        layer = with_mlp(
            ModuleSpec(module=cls, params={"impl": impl}, submodules=stock_submodules())
        )
        log.messages.clear()
        with global_groups(None):
            pg = collection(2)
            model = build_gpt(swiglu_config(tensor_model_parallel_size=2), layer, 0, pg)
            _check_model_groups(model, pg, 2, f"user ModuleSpec of {cls.__name__}")
            assert type(model.decoder.layers[0].mlp) is cls
        logged[cls] = list(log.messages)
    if not BUILDER_API:

        class Unrecognised(MLP):
            """Any other MLP subclass, which 0.16-0.17 build on no group, with a warning."""

        layer = with_mlp(ModuleSpec(module=Unrecognised, submodules=stock_submodules()))
        log.messages.clear()
        with global_groups(1):  # the group it falls back to
            build_gpt(swiglu_config(num_layers=1), layer, 0, collection(1))
        logged[Unrecognised] = list(log.messages)
    if dist.get_rank() != 0:  # Megatron logs on rank 0 only
        return
    for cls in (ParMLPMegatron, SwiGLUActivationMLP):
        if BUILDER_API:
            assert any("Rewrapping ModuleSpec" in m for m in logged[cls]), logged
        else:
            assert logged[cls] == [], logged
    if not BUILDER_API:
        assert any("Unknown MLP type" in m for m in logged[Unrecognised]), logged


def with_mlp(mlp: ModuleSpec) -> ModuleSpec:
    """Megatron's local GPT layer spec with ``mlp`` in its mlp slot (a copy: specs are shared)."""
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


@contextlib.contextmanager
def global_groups(tp: int | None) -> Iterator[None]:
    """parallel_state initialized at TP ``tp`` (None: left uninitialized), with the CPU shims."""
    if tp is not None:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        shim_cuda_only_calls()  # after: initialize refuses a memory buffer already set
        yield
    finally:
        parallel_state.destroy_model_parallel()  # drops the buffer too


def _worker(rank: int, world_size: int, rendezvous: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
    )
    log = _Records()
    logging.getLogger(LAYER_LOGGER).addHandler(log)
    try:
        for model_tp, global_tp in SETUPS:
            with global_groups(global_tp):
                _setup(model_tp, global_tp, log)
        _user_module_spec(log)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gpt_model_with_custom_process_groups() -> None:
    spawn(_worker, WORLD)


def test_no_group_is_refused_not_guessed(one_rank_gloo) -> None:
    """torch.distributed up, parallel_state not, no group given: the model's groups may exist
    elsewhere, so the MLP refuses instead of building on a guess; a tp_group that is not the
    collection's is refused too."""
    assert not parallel_state.model_parallel_is_initialized()
    config = swiglu_config()
    with pytest.raises(ValueError, match=r"no TP process group and megatron\.core\.parallel_state"):
        ParMLPMegatron(config, stock_submodules())
    world = dist.group.WORLD
    own = dist.new_group([0])
    with pytest.raises(ValueError, match=r"tp_group \(ranks \[0\]\) and pg_collection\.tp \(ranks"):
        ParMLPMegatron(
            config, stock_submodules(), tp_group=world, pg_collection=ProcessGroupCollection(tp=own)
        )
    with pytest.raises(ValueError, match="pg_collection has no tp group"):
        ParMLPMegatron(config, stock_submodules(), pg_collection=ProcessGroupCollection())
    mlp = ParMLPMegatron(config, stock_submodules(), pg_collection=ProcessGroupCollection(tp=own))
    assert mlp.tp_group is own and mlp.linear_fc1.tp_group is own


def test_wrong_fc1_shape_is_named_before_repacking(one_rank_gloo) -> None:
    """A stock state_dict of another ffn size loaded into a packed fc1: the error names the
    parameter and both shapes (it said only that the chunk did not divide the size)."""
    config = swiglu_config()
    tp = dist.group.WORLD
    packed = ParMLPMegatron(config, stock_submodules(), impl="save_factors", tp_group=tp)
    other = swiglu_config(ffn_hidden_size=40)  # 40 rows per half: not a multiple of chunk 16
    state = MLP(other, stock_submodules(), ffn_hidden_size=other.ffn_hidden_size, tp_group=tp)
    with pytest.raises(ValueError, match=r"linear_fc1\.weight: .* shape \(80, 32\), .* \(96, 32\)"):
        packed.load_state_dict(state.state_dict())
