"""The quack impls on GPUs other than Hopper: refused in one line (never a compiler trace or an
untested number), and left out of impl="auto"; on CPU, by faking the capability query."""

from types import SimpleNamespace

import pytest
import torch
from helpers import auto_model

from swiglu_train.layers import auto
from swiglu_train.layers.auto import AutoModel, resolve
from swiglu_train.layers.registry import QUACK_IMPLS
from swiglu_train.ops import quack_mlp

SM100 = "compute capability 10.0 is not Hopper (9.x): our quack GEMM configs and epilogues are "
SM100 += "built for sm_90 and untested on newer GPUs"


@pytest.mark.parametrize(
    ("capability", "reason"),
    [
        ((9, 0), None),
        ((8, 9), "compute capability 8.9 is below 9.0 (Hopper)"),
        ((10, 0), SM100),
        ((12, 0), SM100.replace("10.0", "12.0")),
    ],
)
def test_only_hopper_runs_the_quack_impls(capability, reason):
    assert quack_mlp.capability_refusal(capability) == reason


@pytest.fixture
def sm100(monkeypatch):
    """This process on one CUDA GPU of compute capability 10.0 (a B200), as the quack impls
    ask for it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(quack_mlp, "device_capability", lambda index: (10, 0))
    quack_mlp._unavailable_reason.cache_clear()
    yield
    quack_mlp._unavailable_reason.cache_clear()


def test_on_sm100_the_quack_impls_are_unavailable_before_quack_is_imported(sm100, monkeypatch):
    def no_import():
        raise AssertionError("quack must not be loaded to refuse a GPU")

    monkeypatch.setattr(quack_mlp, "require_quack", no_import)
    assert quack_mlp.quack_unavailable_reason() == SM100
    assert not quack_mlp.quack_available()


@pytest.mark.parametrize("impl", sorted(QUACK_IMPLS))
def test_a_named_quack_impl_refuses_an_sm100_input_in_one_line(sm100, impl):
    x = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), get_device=lambda: 0)
    weights = torch.empty(80, 16), torch.empty(16, 40)
    with pytest.raises(ValueError) as e:
        quack_mlp.check_quack_inputs(x, *weights, impl)
    portable = impl.removesuffix("_quack")
    assert str(e.value) == f"impl {impl!r} cannot run on cuda:0: {SM100}; use impl {portable!r}"


def test_auto_on_sm100_picks_no_quack_impl(sm100):
    quack_fastest = {"normal": (1.05, 6.0), "drop_h": (1.06, 4.0), "drop_h_quack": (1.0, 4.0)}
    model = AutoModel.from_dict(auto_model(quack_fastest, family="B200"))
    resolution = resolve(4096, 4096, 11008, "NVIDIA B200", model)
    assert resolution.impl == "normal"
    assert auto.quack_available() is False
