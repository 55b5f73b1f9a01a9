"""ParMLP under FSDP2 (fully_shard): on a 1-rank gloo group, where fc1 is a DTensor, and on four
gloo ranks (one spawn for every case), where fc1's rows and Adam's moments are split over ranks
and a layout change moves rows between them."""

import copy
import os
import tempfile

import pytest
import torch

from swiglu_train import ParMLP
from swiglu_train.layers import PORTABLE_IMPLS
from swiglu_train.ops.activation import use_backend

fsdp = pytest.importorskip("torch.distributed.fsdp")
checkpoint = pytest.importorskip("torch.distributed.checkpoint.state_dict")


@pytest.mark.parametrize(
    ("impl", "other"), [("normal", "save_factors"), ("save_factors", "drop_h")]
)
def test_sharded_fc1_is_relaid_out_on_switch_and_load(one_rank_gloo, impl, other):
    """index_select on a DTensor with a plain index raised "mixed torch.Tensor and DTensor";
    a full canonical checkpoint loaded through DCP into a packed FSDP2 model is the common case."""
    reference = ParMLP(16, 32, bias=True, impl=impl, chunk=8)
    x = torch.randn(5, 16)
    expected = reference(x).detach()

    switched = fsdp.fully_shard(copy.deepcopy(reference))
    switched.set_impl(other)
    assert type(switched.fc1.weight).__name__ == "DTensor" and switched.impl == other
    torch.testing.assert_close(switched(x), expected)

    with torch.device("meta"):  # deferred init, as FSDP2 recipes build models
        loaded = ParMLP(16, 32, bias=True, impl=other, chunk=8)
    fsdp.fully_shard(loaded)
    loaded.to_empty(device="cpu")
    loaded.load_state_dict(fsdp.fully_shard(copy.deepcopy(reference)).state_dict())
    torch.testing.assert_close(loaded(x), expected)

    full = fsdp.fully_shard(ParMLP(16, 32, bias=True, impl=other, chunk=8))
    options = checkpoint.StateDictOptions(full_state_dict=True)
    checkpoint.set_model_state_dict(full, reference.state_dict(), options=options)
    torch.testing.assert_close(full(x), expected)
    state = checkpoint.get_model_state_dict(full, options=options)  # and back, full
    back = ParMLP(16, 32, bias=True, impl=impl, chunk=8)
    back.load_state_dict(state)
    torch.testing.assert_close(back(x), expected)


def test_switch_impl_moves_sharded_optimizer_state_with_fc1(one_rank_gloo):
    """FSDP2's optimizer state is a DTensor like its parameter: switch_impl must permute Adam's
    moments with fc1's rows there too (index_select with a plain index raised before)."""
    from swiglu_train.layers.layout import CANONICAL, Layout, order
    from swiglu_train.packing import switch_impl

    model = fsdp.fully_shard(ParMLP(16, 32, bias=True, impl="normal"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(5, 16)
    model(x).square().sum().backward()
    optimizer.step()
    before = {k: v.full_tensor().clone() for k, v in optimizer.state[model.fc1.weight].items()
              if v.dim() > 0}  # fmt: skip
    expected = model(x).detach()
    # FSDP2's root keeps its params unsharded after a forward: fc1.weight is then not the
    # tensor the optimizer holds, and its moments would silently keep the old row order
    with pytest.raises(
        ValueError, match=r"fc1\.weight is not one of the optimizer's param.*reshard"
    ):
        switch_impl(model, "save_factors", optimizer)
    assert model.impl == "normal"
    model.reshard()

    assert switch_impl(model, "save_factors", optimizer) == [""]
    index = order(64, CANONICAL, Layout("packed", model.fc1_layout.chunk))
    after = optimizer.state[model.fc1.weight]
    assert set(before) == {"exp_avg", "exp_avg_sq"}
    for key, value in before.items():
        assert type(after[key]).__name__ == "DTensor"
        assert torch.equal(after[key].full_tensor(), value[index])
    torch.testing.assert_close(model(x), expected)


WORLD = 4
# F = 15 with chunk 5: fc1's 30 rows shard 8/8/8/6 (uneven, FSDP2 pads the last), and the packed
# layout's chunks cross those shard boundaries.
D, F, CHUNK, ROWS_PER_RANK = 16, 15, 5, 2


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``i``'s global batch (the same on every rank) and its regression target."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(WORLD * ROWS_PER_RANK, D, generator=g)
    return x, torch.randn(WORLD * ROWS_PER_RANK, D, generator=g)


def step(model, optimizer, i: int, rank: int | None) -> torch.Tensor:
    """One Adam step on the global batch (rank None) or on this rank's rows of it; returns the
    loss of the whole global batch: the mean of the ranks' equal-sized means."""
    x, target = data(i)
    if rank is not None:
        x, target = (t.chunk(WORLD)[rank] for t in (x, target))
    optimizer.zero_grad()
    loss = (model(x) - target).square().mean()
    loss.backward()
    optimizer.step()
    loss = loss.detach()
    if rank is not None:
        torch.distributed.all_reduce(loss)
        loss /= WORLD
    return loss


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if type(t).__name__ == "DTensor" else t


def assert_same_state(sharded, reference, sharded_opt, reference_opt, label: str) -> None:
    """Parameters, grads and Adam state of the sharded model, gathered, equal the one-process
    model's (fp32: the collectives only change the summation order)."""
    pairs = zip(sharded.named_parameters(), reference.named_parameters(), strict=True)
    for (name, p), (ref_name, q) in pairs:
        assert name == ref_name and type(p).__name__ == "DTensor", (label, name)
        torch.testing.assert_close(full(p), q, msg=f"{label}: {name}")
        torch.testing.assert_close(full(p.grad), q.grad, msg=f"{label}: {name}.grad")
        state, ref_state = sharded_opt.state[p], reference_opt.state[q]
        assert state.keys() == ref_state.keys() == {"step", "exp_avg", "exp_avg_sq"}, label
        for key, value in ref_state.items():
            torch.testing.assert_close(full(state[key]), value, msg=f"{label}: {name} {key}")


def _impl_parity(rank: int) -> None:
    """Every portable impl: three Adam steps with each rank on its quarter of the global batch
    give the one-process losses, grads and state."""
    for impl in PORTABLE_IMPLS:
        torch.manual_seed(0)
        reference = ParMLP(D, F, bias=True, impl=impl, chunk=CHUNK)
        sharded = fsdp.fully_shard(copy.deepcopy(reference))
        local = sharded.fc1.weight.to_local().shape[0]
        assert local == (8 if rank < 3 else 6), f"{impl}: rank {rank} holds {local} fc1 rows"
        reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
        sharded_opt = torch.optim.Adam(sharded.parameters(), lr=1e-2)
        for i in range(3):
            expected = step(reference, reference_opt, i, None)
            loss = step(sharded, sharded_opt, i, rank)
            torch.testing.assert_close(loss, expected, msg=f"{impl} step {i}: loss")
            assert_same_state(sharded, reference, sharded_opt, reference_opt, f"{impl} step {i}")


def _switch_keeps_optimizer_state(rank: int) -> None:
    """normal -> save_factors -> drop_h between Adam steps, sharded and on one process: fc1's
    rows and moments move across the ranks' shards, and the runs stay the same run."""
    from swiglu_train.packing import switch_impl

    torch.manual_seed(1)
    reference = ParMLP(D, F, bias=True, impl="normal", chunk=CHUNK)
    sharded = fsdp.fully_shard(copy.deepcopy(reference))
    reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    sharded_opt = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    for i, impl in enumerate(("normal", "save_factors", "drop_h")):
        if impl != "normal":
            sharded.reshard()  # the root keeps its parameters unsharded after a forward
            assert switch_impl(sharded, impl, sharded_opt) == [""], impl
            assert switch_impl(reference, impl, reference_opt) == [""], impl
            assert sharded.fc1_layout == reference.fc1_layout, impl
            assert_same_state(sharded, reference, sharded_opt, reference_opt, f"to {impl}")
        expected = step(reference, reference_opt, i, None)
        loss = step(sharded, sharded_opt, i, rank)
        torch.testing.assert_close(loss, expected, msg=f"{impl} step {i}: loss")
        assert_same_state(sharded, reference, sharded_opt, reference_opt, f"{impl} step {i}")


def _world4_worker(rank: int, rendezvous: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD
    )
    try:
        # Plain-torch activations: the subject is sharding and layouts; the kernels (tested under
        # the Triton interpreter elsewhere) would take most of the time here.
        with use_backend("torch"):
            _impl_parity(rank)
            _switch_keeps_optimizer_state(rank)
        # No rank tears gloo down while another is still in a collective: a rank that did
        # aborted in gloo's destructor ("terminate called without an active exception").
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_four_ranks_match_one_process_and_switch_with_optimizer_state() -> None:
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        torch.multiprocessing.spawn(_world4_worker, args=(rendezvous,), nprocs=WORLD)
