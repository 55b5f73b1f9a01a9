"""swiglu_train.patch's walker, report and guards, on MLPs written the way users write them."""

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import auto_model, pretend_gpu
from torch import nn

import swiglu_train
from swiglu_train import ParMLP
from swiglu_train.integrations.patch import PatchedSwiGLU


class MyMLP(nn.Module):
    """A user's own copy of transformers' LlamaMLP: recognized by what it is, not its name."""

    def __init__(self, bias: bool = False, act: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(16, 24, bias=bias)
        self.up_proj = nn.Linear(16, 24, bias=bias)
        self.down_proj = nn.Linear(24, 16, bias=bias)
        self.act_fn = act or nn.SiLU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class ScaledMLP(MyMLP):
    def forward(self, x):  # the same layout, another function
        return 0.5 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LoggedLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class Net(nn.Module):
    def __init__(self, *mlps: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(mlps)

    def forward(self, x):
        for mlp in self.layers:
            x = x + mlp(x)
        return x


def test_a_users_copy_is_patched_and_computes_the_same():
    model = Net(MyMLP(bias=True), MyMLP())
    x = torch.randn(4, 16)
    expected = model(x).detach()
    report = swiglu_train.patch(model, "save_factors", chunk=8)
    assert [(r.name, r.host_class, r.impl, r.shape) for r in report.replaced] == [
        ("layers.0", "MyMLP", "save_factors", (16, 24, 16)),
        ("layers.1", "MyMLP", "save_factors", (16, 24, 16)),
    ]
    assert isinstance(model.layers[0], PatchedSwiGLU) and model.layers[0].fc1.bias is not None
    torch.testing.assert_close(model(x), expected)


def test_what_is_not_a_plain_swiglu_mlp_is_left_with_the_reason():
    hooked, mixed, parametrized, quantized = MyMLP(), MyMLP(bias=True), MyMLP(), MyMLP()
    hooked.register_forward_hook(lambda *args: None)
    mixed.down_proj = nn.Linear(24, 16, bias=False)
    nn.utils.parametrizations.weight_norm(parametrized.up_proj)
    quantized.gate_proj = LoggedLinear(16, 24, bias=False)
    odd_shape = MyMLP()
    odd_shape.up_proj = nn.Linear(16, 20, bias=False)
    model = Net(ScaledMLP(), MyMLP(act=nn.GELU()), hooked, mixed, parametrized, quantized,
                odd_shape, MyMLP().double(), nn.Sequential(nn.Linear(16, 16)))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = swiglu_train.patch(model)
    assert report.replaced == []
    reasons = {entry.name: entry.reason for entry in report.left}
    assert "ScaledMLP.forward) is not transformers's SwiGLU forward" in reasons["layers.0"]
    assert "activation GELU is not SiLU" in reasons["layers.1"]
    assert "forward hooks, which a replacement would drop" in reasons["layers.2"]
    assert "only some of its linears have a bias" in reasons["layers.3"]
    assert "up_proj is parametrized" in reasons["layers.4"]
    assert "gate_proj is a LoggedLinear whose forward is not nn.Linear's" in reasons["layers.5"]
    assert "shapes do not chain: gate_proj (24, 16), up_proj (20, 16)" in reasons["layers.6"]
    assert "torch.float64; the impls support" in reasons["layers.7"]
    assert "layers.8" not in reasons  # not MLP-like at all: not reported
    assert set(model.state_dict()) == set(before)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_report_is_returned_logged_and_grouped(caplog):
    model = Net(*(MyMLP() for _ in range(5)), MyMLP(act=nn.ReLU()))
    with caplog.at_level(logging.INFO, logger="swiglu_train.patch"):
        report = swiglu_train.patch(model, "drop_h")
    assert report.impls == {"drop_h": 5}
    summary = report.summary()
    assert summary == str(report) and summary in caplog.text
    assert "replaced 5 x transformers MyMLP -> drop_h: layers.0 and 4 more" in summary
    assert "left 1 x MyMLP: its activation ReLU is not SiLU" in summary
    again = swiglu_train.patch(Net(model, ParMLP(16, 24)))  # patching twice changes nothing
    assert again.replaced == []
    assert [e.reason for e in again.left if e.host_class != "MyMLP"] == [
        *["already patched (impl drop_h)"] * 5,
        "already a ParMLP (impl drop_h)",
    ]


def test_frozen_weights_stay_frozen_and_meta_models_stay_on_meta():
    mlp = MyMLP(bias=True)
    for p in (mlp.gate_proj.weight, mlp.up_proj.weight):
        p.requires_grad_(False)
    model = Net(mlp)
    swiglu_train.patch(model)
    assert not model.layers[0].fc1.weight.requires_grad
    assert model.layers[0].fc1.bias.requires_grad and model.layers[0].fc2.weight.requires_grad
    with torch.device("meta"):
        deferred = Net(MyMLP())
    swiglu_train.patch(deferred, "save_factors", chunk=8)
    assert deferred.layers[0].fc1.weight.is_meta


def test_optimizer_made_before_patch_is_refused_at_its_first_step():
    model = Net(MyMLP())
    early = torch.optim.AdamW(model.parameters())
    swiglu_train.patch(model)
    late = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    late.step()  # made after patch: trains the patched MLP
    with pytest.raises(RuntimeError, match=r"holds layers\.0\.gate_proj\.weight and 2 more, whi"):
        early.step()


def test_a_refused_option_leaves_the_model_as_it_was():
    model = Net(MyMLP(), MyMLP())
    with pytest.raises(ValueError, match="chunk=5 must be positive and divide"):
        swiglu_train.patch(model, "save_factors", chunk=5)
    assert not any(isinstance(m, PatchedSwiGLU) for m in model.modules())
    with pytest.raises(ValueError, match="unknown MLP impl 'fast'; valid impls: normal"):
        swiglu_train.patch(model, "fast")
    with pytest.raises(TypeError, match=r"patch expects an nn\.Module, got dict"):
        swiglu_train.patch({}, "drop_h")


def test_auto_resolves_per_layer_shape_from_the_tokens_hint(monkeypatch):
    model = Net(MyMLP())
    report = swiglu_train.patch(model, "auto", tokens_hint=4096)  # CPU: the drop_h fallback
    assert report.replaced[0].impl == "drop_h"
    assert "not on a CUDA device" in report.replaced[0].auto_reason
    pretend_gpu(monkeypatch, auto_model({"drop_h": (1.10, 4.0), "save_factors": (1.0, 6.0)}))
    report = swiglu_train.patch(Net(MyMLP()), "auto", tokens_hint=4096)
    assert report.replaced[0].impl == "save_factors"
    assert "save_factors: fastest" in report.summary()


def test_a_sharded_mlp_is_left(one_rank_gloo):
    from torch.distributed.fsdp import fully_shard

    model = Net(fully_shard(MyMLP()))
    report = swiglu_train.patch(model)
    assert "DTensors (already sharded): patch before fully_shard" in report.left[0].reason


def test_import_swiglu_train_does_not_import_the_host_libraries():
    code = (
        "import sys, swiglu_train; "
        "assert 'swiglu_train.integrations.patch' not in sys.modules; "
        "swiglu_train.patch; "
        "assert not {'transformers', 'litgpt', 'torchtitan'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
