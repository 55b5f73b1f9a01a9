"""ParMLP under FSDP2 (fully_shard) on a 1-rank gloo group: its fc1 is a DTensor there."""

import copy

import pytest
import torch

from swiglu_train import ParMLP

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
