"""swiglu_train.patch on torchtitan 0.3's own MoE (router, routed experts, shared experts).

torchtitan's GroupedExperts runs its GEMMs in bf16 whatever its weights' dtype, and so do the
patched experts: the two are compared in bf16 within bf16 rounding, and in fp32 (torchtitan's
``.bfloat16()`` casts made no-ops, the patched experts' ``compute_dtype`` None) within fp32
rounding, outputs and every gradient, the router's included.
"""

import copy

import pytest
import torch
from helpers import rel_err
from patch_models import PARITY, assert_close_all, assert_state_equal, host_grads

import swiglu_train
from swiglu_train.integrations.patch.torchtitan_experts import PatchedRoutedExperts

moe = pytest.importorskip(
    "torchtitan.models.common.moe",
    reason="torchtitan 0.3 needs Python >= 3.11 and installs with the test extra",
)
from torchtitan.models.common.feed_forward import FeedForward  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.token_dispatcher import (  # noqa: E402
    AllToAllTokenDispatcher,
    LocalTokenDispatcher,
)
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts  # noqa: E402

D, F, E, K = 32, 16, 4, 2
KEYS = ["expert_bias_E", "routed_experts.inner_experts.w1_EFD",
        "routed_experts.inner_experts.w2_EDF", "routed_experts.inner_experts.w3_EFD",
        "router.gate.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
        "shared_experts.w3.weight"]  # fmt: skip
BF16 = 2e-2  # bf16 GEMMs and SwiGLU rounded in another order: seen 6e-3


def linear(i: int, o: int) -> Linear.Config:
    return Linear.Config(in_features=i, out_features=o)


def build_moe(experts=moe.GroupedExperts, dispatcher=LocalTokenDispatcher, seed: int = 0):
    """A MoE of E=4 experts, top-2 softmax routing (normalized), a shared SwiGLU expert."""
    config = moe.MoE.Config(
        num_experts=E,
        routed_experts=moe.RoutedExperts.Config(
            inner_experts=experts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=dispatcher.Config(num_experts=E, top_k=K),
        ),
        router=moe.TokenChoiceTopKRouter.Config(
            num_experts=E, gate=linear(D, E), top_k=K, score_func="softmax", route_norm=True
        ),
        shared_experts=FeedForward.Config(w1=linear(D, F), w2=linear(F, D), w3=linear(D, F)),
    )
    torch.manual_seed(seed)
    model = config.build().train()
    for p in model.parameters():  # torchtitan leaves init to init_states; any values do here
        torch.nn.init.normal_(p, std=0.2)
    return model


def step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, grad of x) of one backward of a fixed projection; grads left on the model."""
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
    return y.detach(), x.grad


def patched_pair(**options):
    reference = build_moe()
    patched = copy.deepcopy(reference)
    return reference, patched, swiglu_train.patch(patched, **options)


@pytest.mark.parametrize("impl", ["normal", "drop_h"])
def test_patched_moe_matches_torchtitan_in_fp32(monkeypatch, impl):
    reference, patched, report = patched_pair(impl=impl)
    assert [(r.name, r.library, r.host_class, r.impl, r.num_experts) for r in report.replaced] == [
        ("routed_experts", "torchtitan", "RoutedExperts", impl, E),
        ("shared_experts", "torchtitan", "FeedForward", impl, None),
    ]
    assert report.left == []
    assert isinstance(patched.routed_experts, PatchedRoutedExperts)
    assert list(patched.state_dict()) == KEYS
    assert_state_equal(patched.state_dict(), reference.state_dict())

    patched.routed_experts.inner_experts.compute_dtype = None  # the weights' fp32
    x = torch.randn(2, 6, D)
    y, grad_x = step(patched, x)
    with monkeypatch.context() as fp32:  # torchtitan's experts in fp32: its casts do nothing
        fp32.setattr(torch.Tensor, "bfloat16", lambda t: t)
        ref_y, ref_grad_x = step(reference, x)
    assert rel_err(y, ref_y) < PARITY and rel_err(grad_x, ref_grad_x) < PARITY
    assert_close_all(host_grads(patched), host_grads(reference))  # router and shared expert too
    assert torch.equal(patched.tokens_per_expert_E, reference.tokens_per_expert_E)


def test_patched_moe_matches_torchtitan_in_bf16():
    """As torchtitan runs it: weights in fp32, the experts' GEMMs in bf16."""
    reference, patched, _ = patched_pair()
    x = torch.randn(2, 6, D)
    y, grad_x = step(patched, x)
    ref_y, ref_grad_x = step(reference, x)
    assert y.dtype == ref_y.dtype == torch.float32
    assert rel_err(y, ref_y) < BF16 and rel_err(grad_x, ref_grad_x) < BF16
    assert_close_all(host_grads(patched), host_grads(reference), BF16)


def test_checkpoints_round_trip_through_the_unpatched_model(tmp_path):
    """Saved by the patched model, loaded into an unpatched one (strictly), and back."""
    _, patched, _ = patched_pair()
    torch.save(patched.state_dict(), tmp_path / "patched.pt")
    plain = build_moe(seed=1)
    plain.load_state_dict(torch.load(tmp_path / "patched.pt"))
    assert_state_equal(plain.state_dict(), patched.state_dict())
    other = build_moe(seed=2)
    torch.save(other.state_dict(), tmp_path / "plain.pt")
    patched.load_state_dict(torch.load(tmp_path / "plain.pt"))
    assert_state_equal(patched.state_dict(), other.state_dict())
    inner = patched.routed_experts.inner_experts
    assert torch.equal(inner.w3_EFD, other.routed_experts.inner_experts.w3_EFD)

    state = other.state_dict()
    del state["routed_experts.inner_experts.w3_EFD"]
    with pytest.raises(RuntimeError, match=r"w1_EFD is given without .*w3_EFD: fc1 needs both"):
        patched.load_state_dict(state)
    state = other.state_dict()
    state["routed_experts.inner_experts.w1_EFD"] = torch.zeros(E, F + 1, D)
    with pytest.raises(RuntimeError, match=r"size mismatch for routed_experts\.inner_experts\.w1"):
        patched.load_state_dict(state)


def test_an_optimizer_made_before_patch_is_refused_for_the_joined_weights():
    model = build_moe()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    swiglu_train.patch(model)
    inner = model.routed_experts.inner_experts
    assert inner.fc2_weight is inner.w2_EDF  # w2 adopted; w1 and w3 became fc1
    with pytest.raises(RuntimeError, match=r"holds routed_experts\.inner_experts\.w1_EFD and "):
        early.step()


def test_fsdp2_fully_shard_after_patch(one_rank_gloo):
    import torch.distributed.checkpoint.state_dict as dcp
    from torch.distributed.fsdp import fully_shard

    reference, patched, _ = patched_pair()
    fully_shard(patched)
    state = patched.state_dict()
    assert list(state) == KEYS
    for key, value in reference.state_dict().items():
        whole = state[key].full_tensor() if key != "expert_bias_E" else state[key]  # a buffer
        assert torch.equal(whole, value), key
    x = torch.randn(2, 6, D)
    y, grad_x = step(patched, x)
    ref_y, ref_grad_x = step(reference, x)
    assert rel_err(y, ref_y) < BF16 and rel_err(grad_x, ref_grad_x) < BF16
    other, full = build_moe(seed=1), dcp.StateDictOptions(full_state_dict=True)
    dcp.set_model_state_dict(patched, other.state_dict(), options=full)
    assert_state_equal(dcp.get_model_state_dict(patched, options=full), other.state_dict())


def test_what_is_not_torchtitans_swiglu_routed_experts_is_left():
    gpt_oss = build_moe(experts=GptOssGroupedExperts)
    expert_parallel = build_moe(dispatcher=AllToAllTokenDispatcher)
    mxfp8 = build_moe()
    mxfp8.routed_experts.inner_experts._grouped_mm = lambda **kwargs: None
    model = torch.nn.ModuleList([gpt_oss, expert_parallel, mxfp8])
    report = swiglu_train.patch(model)
    assert [r.name for r in report.replaced] == [f"{i}.shared_experts" for i in range(3)]
    assert {e.name: e.reason for e in report.left} == {  # the insides are not reported again
        "0.routed_experts": "its inner_experts is a GptOssGroupedExperts, not torchtitan's "
        "GroupedExperts (another activation, weight layout or grouped GEMM)",
        "1.routed_experts": "its token dispatcher (AllToAllTokenDispatcher) exchanges tokens "
        "across expert-parallel ranks: patch supports EP = 1 only",
        "2.routed_experts": "its inner_experts' _grouped_mm was replaced (a low-precision GEMM)",
    }
