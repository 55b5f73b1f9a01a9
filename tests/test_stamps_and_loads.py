"""Layout stamps are read by one validator that takes only what the writer writes, and a
refused load_state_dict leaves the whole model as it was."""

import types

import numpy as np
import pytest
import torch
from torch import nn

from swiglu_train import ParMLP
from swiglu_train.layers.layout import CANONICAL, Layout, read_stamp
from swiglu_train.packing import convert_checkpoint

STAMP = "_extra_state"
# (field, refused value, how the message shows it)
BAD_FIELDS = [
    ("chunk", True, "True (bool)"),  # True == 1: it loaded fc1 scrambled as chunk 1
    ("chunk", "16", "'16'"),  # a bare TypeError from '<'
    ("chunk", 32.0, "32.0 (float)"),  # torch's view() error
    ("chunk", np.int64(16), "(int64)"),
    ("chunk", 0, "0"),
    ("chunk", None, "None"),
    ("tp", False, "False (bool)"),
    ("tp", 1.0, "1.0 (float)"),
    ("tp", "1", "'1'"),
    ("tp", 0, "0"),
    ("kind", "Packed", "'Packed'"),
    ("kind", 1, "1"),
]


def bad_stamp(field: str, value: object) -> dict:
    layout = {"kind": "packed", "chunk": 8, "tp": 1}
    layout[field] = value
    return {"fc1_layout": layout}


def assert_names(error: pytest.ExceptionInfo, key: str, field: str, shown: str) -> None:
    message = str(error.value)
    assert message.startswith(f"{key} fc1_layout: "), message
    assert f"field '{field}'" in message and shown in message, message


@pytest.mark.parametrize(("field", "value", "shown"), BAD_FIELDS)
def test_par_mlp_load_refuses_a_stamp_its_writer_would_not_write(field, value, shown):
    source = ParMLP(16, 32, impl="save_factors", chunk=8)
    target = ParMLP(16, 32, impl="drop_h")
    before = target.fc1.weight.detach().clone()
    state = source.state_dict()
    state[STAMP] = bad_stamp(field, value)
    with pytest.raises(ValueError) as error:
        target.load_state_dict(state)
    assert_names(error, STAMP, field, shown)
    assert torch.equal(target.fc1.weight, before)


@pytest.mark.parametrize(("field", "value", "shown"), BAD_FIELDS)
def test_convert_checkpoint_refuses_the_same_stamps(field, value, shown):
    model = nn.Sequential(ParMLP(16, 32, impl="save_factors", chunk=8))
    state = model.state_dict()
    state[f"0.{STAMP}"] = bad_stamp(field, value)
    with pytest.raises(ValueError) as error:
        convert_checkpoint(state, to="canonical")
    assert_names(error, f"0.{STAMP}", field, shown)


@pytest.mark.parametrize(("field", "value", "shown"), BAD_FIELDS)
def test_the_megatron_adapter_refuses_the_same_stamps(field, value, shown):
    packed = pytest.importorskip("swiglu_train.integrations.megatron.packed")
    module = types.SimpleNamespace(fc1_layout=Layout("packed", 8))
    state = {"mlp.linear_fc1.weight": torch.zeros(64, 16), f"mlp.{STAMP}": bad_stamp(field, value)}
    with pytest.raises(ValueError) as error:
        packed.convert_on_load(module, state, "mlp.")
    assert_names(error, f"mlp.{STAMP}", field, shown)


def test_a_lightning_record_is_read_by_the_same_rules():
    state = nn.Sequential(ParMLP(16, 32, impl="drop_h")).state_dict()
    record = {"fc1_layout": bad_stamp("chunk", True)["fc1_layout"]}
    message = r"^swiglu_train\.fc1_layout: field 'chunk' is True \(bool\)"
    with pytest.raises(ValueError, match=message):
        convert_checkpoint({"state_dict": state, "swiglu_train": record}, to="packed", chunk=8)


@pytest.mark.parametrize(
    "layout", [Layout("packed", 1), Layout("packed", 16), Layout("packed", 4, 2), CANONICAL]
)
def test_every_stamp_the_writers_write_reads_back(layout):
    assert read_stamp({"fc1_layout": layout.to_dict()}, "k") == layout


def test_stamps_written_by_par_mlp_and_convert_read_back():
    mlp = ParMLP(16, 32, impl="save_factors", chunk=np.int32(4))
    assert read_stamp(mlp.state_dict()[STAMP], STAMP) == Layout("packed", 4)
    state = nn.Sequential(ParMLP(16, 32, impl="drop_h")).state_dict()
    packed = convert_checkpoint(state, to="packed", chunk=np.int64(8))  # a numpy chunk: an int
    assert type(packed[f"0.{STAMP}"]["fc1_layout"]["chunk"]) is int
    loaded = ParMLP(16, 32, impl="save_factors", chunk=2)
    loaded.load_state_dict({k.removeprefix("0."): v for k, v in packed.items()})


def test_a_stamp_whose_chunk_cannot_divide_fc1_names_the_key():
    state = ParMLP(16, 48, impl="save_factors", chunk=16).state_dict()
    state[STAMP] = {"fc1_layout": {"kind": "packed", "chunk": 32, "tp": 1}}
    with pytest.raises(ValueError, match=rf"^{STAMP}: fc1 cannot be read as packed\(chunk=32"):
        ParMLP(16, 48, impl="drop_h").load_state_dict(state)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = ParMLP(16, 32, bias=True, impl="save_factors", chunk=8)


class Model(nn.Module):
    """Built top-down: the list is registered empty, the blocks appended later."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(Block())
        self.head = nn.Linear(16, 10)


def snapshot(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} was written by a refused load"


def spoil_last_layer(state: dict, how: str, prefix: str) -> None:
    if how == "stamp":
        state[prefix + STAMP] = bad_stamp("chunk", True)
    elif how == "shape":
        state[prefix + "fc2.weight"] = torch.zeros(16, 31)
    else:  # not a tensor
        state[prefix + "fc1.bias"] = [0.0] * 64


@pytest.mark.parametrize("how", ["stamp", "shape", "value"])
def test_a_refused_load_leaves_every_parameter_as_it_was(how):
    torch.manual_seed(0)
    model, other = Model(), Model()
    state = other.state_dict()
    spoil_last_layer(state, how, "layers.2.mlp.")
    before = snapshot(model)
    for strict in (True, False):
        with pytest.raises((ValueError, RuntimeError), match=r"layers\.2\.mlp\."):
            model.load_state_dict(state, strict=strict)
        assert_unchanged(model, before)
    state = other.state_dict()  # a sound state_dict loads, and the layers compute alike
    model.load_state_dict(state)
    x = torch.randn(5, 16)
    torch.testing.assert_close(model.layers[2].mlp(x), other.layers[2].mlp(x))


def test_a_par_mlp_set_into_a_finished_model_is_checked_from_the_root():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
    model[1][1] = ParMLP(16, 32, impl="save_factors", chunk=8)  # after the tree was built
    state = model.state_dict()
    spoil_last_layer(state, "stamp", "1.1.")
    state["0.weight"] = torch.ones(16, 16)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"^1\.1\._extra_state fc1_layout: field 'chunk'"):
        model.load_state_dict(state)
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match=r"^1\._extra_state fc1_layout"):  # a subtree's load
        model[1].load_state_dict({k.removeprefix("1."): v for k, v in state.items() if k[0] == "1"})
    assert_unchanged(model, before)


def test_a_bottom_up_sequential_of_par_mlps_is_all_or_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(*(ParMLP(16, 32, impl=i) for i in ("drop_h", "save_factors", "normal")))
    state = nn.Sequential(
        *(ParMLP(16, 32, impl=i) for i in ("save_factors", "drop_h", "save_factors"))
    ).state_dict()
    state[f"2.{STAMP}"] = bad_stamp("tp", 1.0)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"^2\._extra_state fc1_layout: field 'tp' is 1\.0"):
        model.load_state_dict(state)
    assert_unchanged(model, before)
