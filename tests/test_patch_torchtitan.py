"""swiglu_train.patch on torchtitan's own FeedForward (torchtitan 0.3, a test dependency).

Its full Llama3 model needs flex attention's block masks to run, so the FeedForward modules
are built from torchtitan's configs and tested in a small container of their own.
"""

import copy

import pytest
import torch
from helpers import rel_err
from patch_models import CHUNK, PARITY, assert_close_all, assert_state_equal, host_grads

import swiglu_train
from swiglu_train import PORTABLE_IMPLS

feed_forward = pytest.importorskip(
    "torchtitan.models.common.feed_forward",
    reason="torchtitan 0.3 needs Python >= 3.11 and installs with the test extra",
)
from torchtitan.models.common.linear import Linear  # noqa: E402 (after the importorskip)

D, F = 32, 64


def feed_forwards(cls=None, **extra) -> torch.nn.Sequential:
    cls = cls or feed_forward.FeedForward
    torch.manual_seed(0)
    linear = Linear.Config
    config = cls.Config(
        w1=linear(in_features=D, out_features=F),
        w2=linear(in_features=F, out_features=D),
        w3=linear(in_features=D, out_features=F),
        **extra,
    )
    model = torch.nn.Sequential(config.build(), config.build())
    for p in model.parameters():  # torchtitan leaves init to init_states; any values do here
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("impl", PORTABLE_IMPLS)
def test_patched_feed_forward_computes_and_saves_as_the_original(impl):
    reference = feed_forwards()
    patched = copy.deepcopy(reference)
    report = swiglu_train.patch(patched, impl, chunk=CHUNK if impl == "save_factors" else None)
    assert [(r.name, r.library, r.host_class) for r in report.replaced] == [
        ("0", "torchtitan", "FeedForward"),
        ("1", "torchtitan", "FeedForward"),
    ]
    state = patched.state_dict()
    assert list(state) == ["0.w1.weight", "0.w2.weight", "0.w3.weight",
                           "1.w1.weight", "1.w2.weight", "1.w3.weight"]  # fmt: skip
    assert_state_equal(state, reference.state_dict())

    x = torch.randn(3, 5, D)
    outputs = {}
    for name, model in (("patched", patched), ("reference", reference)):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.backward(torch.ones_like(y))
        outputs[name] = (y.detach(), xi.grad)
    assert rel_err(outputs["patched"][0], outputs["reference"][0]) < PARITY
    assert rel_err(outputs["patched"][1], outputs["reference"][1]) < PARITY
    assert_close_all(host_grads(patched), host_grads(reference))

    other = feed_forwards()
    with torch.no_grad():
        other[1].w3.weight.mul_(3)
    patched.load_state_dict(other.state_dict())
    assert_state_equal(patched.state_dict(), other.state_dict())


def test_sigmoid_gated_feed_forward_is_left():
    model = feed_forwards(feed_forward.SigmoidGatedFeedForward,
                          gate=Linear.Config(in_features=D, out_features=D))  # fmt: skip
    report = swiglu_train.patch(model)
    assert report.replaced == []
    assert [(e.name, e.host_class) for e in report.left] == [
        ("0", "SigmoidGatedFeedForward"),
        ("1", "SigmoidGatedFeedForward"),
    ]
    assert "children: w1, w2, w3, gate" in report.left[0].reason
