"""The packed fc1 layout: exact permutations, stamps, conversion on load, impl switching."""

import pytest
import torch

from swiglu_train import ParMLP
from swiglu_train.layers.layout import CANONICAL, Layout, packed_order, relayout
from swiglu_train.memory import SavedTensorCounter
from swiglu_train.ops import SECOND_BACKWARD_ERROR_FACTORS


@pytest.mark.parametrize(("ffn", "chunk", "tp"), [(8, 2, 1), (8, 2, 2), (24, 4, 3), (6, 1, 2)])
def test_round_trip_is_bit_exact_and_chunks_hold_pairs(ffn, chunk, tp):
    w = torch.randn(2 * ffn, 5)
    packed = Layout("packed", chunk, tp)
    p = relayout(w, CANONICAL, packed)
    assert torch.equal(relayout(p, packed, CANONICAL), w)
    local = ffn // tp
    for rank in range(tp):  # each rank's shard is its own [gate_c | up_c] chunks
        shard = p[rank * 2 * local : (rank + 1) * 2 * local]
        for c in range(local // chunk):
            start = rank * local + c * chunk
            gate, up = (
                shard[2 * c * chunk : (2 * c + 1) * chunk],
                shard[(2 * c + 1) * chunk :][:chunk],
            )
            assert torch.equal(gate, w[start : start + chunk])
            assert torch.equal(up, w[ffn + start : ffn + start + chunk])
    other = Layout("packed", 1, tp)
    assert torch.equal(relayout(relayout(p, packed, other), other, packed), p)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match="even number"):
        packed_order(7, 1)
    with pytest.raises(ValueError, match="not divisible by chunk=3"):
        packed_order(16, 3)
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        packed_order(16, 2, 3)
    with pytest.raises(ValueError, match="needs a positive chunk"):
        Layout("packed")
    with pytest.raises(ValueError, match="unknown fc1 layout kind 'interleaved'"):
        Layout("interleaved", 2)
    with pytest.raises(ValueError, match="unrecognised fc1 layout stamp"):
        Layout.from_dict({"kind": "packed", "chunk": 4})


def test_switching_impls_keeps_the_function():
    torch.manual_seed(0)
    mlp = ParMLP(16, 24, bias=True, impl="normal")
    x = torch.randn(9, 16)
    expected = mlp(x)
    with pytest.raises(ValueError, match=r"repacks fc1.*switch_impl\(model, impl, optimizer\)"):
        mlp.impl = "save_factors"
    assert mlp.impl == "normal" and mlp.fc1_layout == CANONICAL
    canonical_w = mlp.fc1.weight.detach().clone()
    index = mlp.set_impl("save_factors")
    assert torch.equal(mlp.fc1.weight, canonical_w[index])
    assert mlp.fc1_layout == Layout("packed", 8)  # gcd(24, 128)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-6, atol=1e-6)
    mlp.set_impl("drop_h")
    assert torch.equal(mlp.fc1.weight, canonical_w)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-6, atol=1e-6)


def test_state_dicts_are_stamped_and_converted_on_load():
    torch.manual_seed(0)
    canonical = ParMLP(16, 24, bias=True, impl="drop_h")
    x = torch.randn(5, 16)
    assert "_extra_state" not in canonical.state_dict()  # the ecosystem's layout: no stamp
    packed = ParMLP(16, 24, bias=True, impl="save_factors", chunk=4)
    packed.load_state_dict(canonical.state_dict())  # canonical -> packed on load
    torch.testing.assert_close(packed(x), canonical(x), rtol=1e-6, atol=1e-6)
    stamp = packed.state_dict()["_extra_state"]
    assert stamp == {"fc1_layout": {"kind": "packed", "chunk": 4, "tp": 1}}
    other_chunk = ParMLP(16, 24, bias=True, impl="save_factors", chunk=2)
    other_chunk.load_state_dict(packed.state_dict())  # packed(4) -> packed(2)
    back = ParMLP(16, 24, bias=True, impl="normal")
    back.load_state_dict(other_chunk.state_dict())  # packed(2) -> canonical
    assert torch.equal(back.fc1.weight, canonical.fc1.weight)
    assert torch.equal(back.fc1.bias, canonical.fc1.bias)
    bad = packed.state_dict()
    bad["_extra_state"] = {"fc1_layout": "packed"}
    with pytest.raises(ValueError, match="unrecognised fc1 layout stamp 'packed'"):
        canonical.load_state_dict(bad)


def test_save_factors_saves_what_normal_saves():
    m, d, f = 13, 16, 24
    x = torch.randn(m, d, requires_grad=True)
    saved = {}
    for impl in ("normal", "save_factors"):
        mlp = ParMLP(d, f, impl=impl)
        with SavedTensorCounter(exclude=mlp.parameters()) as counter:
            mlp(x).sum().backward()
        saved[impl] = counter.bytes
    assert saved["save_factors"] == saved["normal"] == (m * d + 2 * m * f + m * f) * 4


def test_save_factors_second_backward():
    x = torch.randn(5, 8, requires_grad=True)
    y = ParMLP(8, 16, impl="save_factors")(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError) as info:
        y.sum().backward()
    assert str(info.value) == SECOND_BACKWARD_ERROR_FACTORS
    y = ParMLP(8, 16, impl="save_factors", inplace=False)(x)
    x.grad = None
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_chunk_1_is_quack_s_interleaved_pair_order():
    """save_factors_quack's layout: gate and up of each column side by side, per TP rank."""
    ffn = 6
    w = torch.arange(2 * ffn).float().unsqueeze(1)
    interleaved = relayout(w, CANONICAL, Layout("packed", 1)).flatten().tolist()
    assert interleaved == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]
    per_rank = relayout(w, CANONICAL, Layout("packed", 1, tp=2)).flatten().tolist()
    assert per_rank == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]  # rank 0: 0-2, rank 1: 3-5


def test_packed_chunk_is_fixed_by_the_kernel_or_chosen():
    from swiglu_train.layers.registry import packed_chunk

    assert packed_chunk("save_factors_quack", None, 14336) == 1
    assert packed_chunk("save_factors_quack", 1, 14336) == 1
    with pytest.raises(ValueError, match="packs fc1 with chunk 1, not chunk=64"):
        packed_chunk("save_factors_quack", 64, 14336)
    assert packed_chunk("save_factors", None, 14336) == 128
    assert packed_chunk("save_factors", None, 96) == 32
    with pytest.raises(ValueError, match="chunk=5 must be positive and divide the ffn size 96"):
        packed_chunk("save_factors", 5, 96)


def test_impls_for_layout_is_each_impl_s_own_layout():
    """The names a checkpoint in a layout may carry: every impl is listed under the layout it
    keeps fc1 in (as ParMLP decides it), never under the other kind; save_factors packs by
    any chunk, save_factors_quack by 1 alone."""
    from swiglu_train.layers.registry import MLP_IMPLS, impls_for_layout

    assert impls_for_layout(CANONICAL) == ("normal", "drop_h", "drop_h_quack")
    assert impls_for_layout(Layout("packed", 1)) == ("save_factors", "save_factors_quack")
    assert impls_for_layout(Layout("packed", 32, tp=2)) == ("save_factors",)
    mlp = ParMLP(16, 64, impl="normal", chunk=16)
    for name in MLP_IMPLS:
        own = mlp._layout_for(name)
        other = CANONICAL if own.packed else Layout("packed", 16)
        assert name in impls_for_layout(own) and name not in impls_for_layout(other), name


def test_no_grad_on_a_chunk_1_fc1_computes_the_canonical_function():
    """Where quack cannot serve (here: CPU), a chunk-1 packed fc1 takes the torch path."""
    from swiglu_train.ops.inference import inference_path, swiglu_mlp_inference

    canonical = ParMLP(16, 24, 8, bias=True, impl="normal")
    x = torch.randn(5, 16)
    packed = Layout("packed", 1)
    w1 = relayout(canonical.fc1.weight.detach(), CANONICAL, packed)
    b1 = relayout(canonical.fc1.bias.detach(), CANONICAL, packed)
    with torch.no_grad():
        assert inference_path(x, w1, canonical.fc2.weight, 1) == "torch"
        y = swiglu_mlp_inference(x, w1, b1, canonical.fc2.weight, canonical.fc2.bias, chunk=1)
        torch.testing.assert_close(y, canonical(x), rtol=1e-6, atol=1e-6)


def test_par_mlp_chunk_is_save_factors_and_left_aside_by_fixed_chunk_impls(monkeypatch):
    """An explicit chunk is refused when named with save_factors_quack, and left aside when
    the model switches to it (or auto picks it): its layout is always chunk 1."""
    from swiglu_train.layers import registry

    monkeypatch.setattr(registry, "require_quack", lambda: None)  # no quack on this machine
    with pytest.raises(ValueError, match="packs fc1 with chunk 1, not chunk=8"):
        ParMLP(16, 32, impl="save_factors_quack", chunk=8)
    mlp = ParMLP(16, 32, impl="save_factors", chunk=8)
    canonical = relayout(mlp.fc1.weight.detach(), mlp.fc1_layout, CANONICAL)
    mlp.set_impl("save_factors_quack")
    assert mlp.fc1_layout == Layout("packed", 1)
    assert torch.equal(mlp.fc1.weight, relayout(canonical, CANONICAL, Layout("packed", 1)))
    mlp.set_impl("save_factors")
    assert mlp.fc1_layout == Layout("packed", 8)


@pytest.mark.parametrize(
    ("source", "target"), [("normal", "save_factors"), ("save_factors", "normal")]
)
def test_a_state_dict_of_another_size_gets_torch_s_size_mismatch(source, target):
    """Not an error about chunks dividing the ffn size, which hid what was wrong."""
    state = ParMLP(16, 24, impl=source, chunk=8).state_dict()
    mlp = ParMLP(16, 32, impl=target, chunk=16)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"size mismatch for fc1\.weight"):
            mlp.load_state_dict(state, strict=strict)


@pytest.mark.parametrize(
    ("impl", "other"), [("normal", "save_factors"), ("save_factors", "drop_h")]
)
def test_a_parametrized_fc1_is_never_relaid_out_silently(impl, other):
    """weight_norm's fc1 is computed: set_impl's copy into it was lost, and a state_dict of
    ``fc1.parametrizations.weight.original*`` keys loaded unconverted, both changing y."""
    from torch.nn.utils.parametrizations import weight_norm

    mlp = ParMLP(16, 32, bias=True, impl=impl, chunk=8)
    weight_norm(mlp.fc1, dim=0)
    x = torch.randn(5, 16)
    expected = mlp(x).detach()
    with pytest.raises(ValueError, match=r"fc1 is parametrized .* cannot be moved"):
        mlp.set_impl(other)
    assert mlp.impl == impl
    torch.testing.assert_close(mlp(x), expected)
    target = ParMLP(16, 32, bias=True, impl=other, chunk=8)
    weight_norm(target.fc1, dim=0)
    with pytest.raises(ValueError, match=r"fc1 is parametrized .* cannot be moved"):
        target.load_state_dict(mlp.state_dict())
    same = ParMLP(16, 32, bias=True, impl=impl, chunk=8)  # same layout: loads as before
    weight_norm(same.fc1, dim=0)
    same.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(same(x), expected)
