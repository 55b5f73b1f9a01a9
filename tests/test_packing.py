"""Layout changes carry optimizer state along, live and in checkpoints."""

from pathlib import Path

import pytest
import torch
from test_pretrain import small_config

from swiglu_train import ParMLP
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.ops import use_backend
from swiglu_train.packing import convert_checkpoint, switch_impl


class TwoLayers(torch.nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            ParMLP(16, 24, bias=bias, impl="normal") for _ in range(2)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def losses(model, optimizer, batches):
    out = []
    for x in batches:
        optimizer.zero_grad()
        loss = model(x)
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda p: torch.optim.Adam(p, lr=1e-2),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    ],
    ids=["adam", "adamw", "sgd-momentum"],
)
def test_live_switch_continues_the_same_training(make_optimizer):
    torch.manual_seed(0)
    batches = [torch.randn(7, 16) for _ in range(8)]
    reference, switched = TwoLayers(), TwoLayers()
    switched.load_state_dict(reference.state_dict())
    opt_ref, opt_sw = make_optimizer(reference.parameters()), make_optimizer(switched.parameters())
    assert losses(reference, opt_ref, batches[:4]) == losses(switched, opt_sw, batches[:4])
    assert switch_impl(switched, "save_factors", opt_sw) == ["layers.0", "layers.1"]
    continued, after_switch = (
        losses(reference, opt_ref, batches[4:]),
        losses(switched, opt_sw, batches[4:]),
    )
    torch.testing.assert_close(after_switch, continued, rtol=1e-6, atol=0)
    switch_impl(switched, "drop_h", opt_sw)  # and back: state is canonical again
    for (_, a), (_, b) in zip(
        reference.named_parameters(), switched.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in opt_ref.state[a]:
            torch.testing.assert_close(
                opt_sw.state[b][key], opt_ref.state[a][key], rtol=1e-6, atol=1e-7
            )


def test_non_elementwise_state_is_refused():
    model = TwoLayers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.layers[1].fc1.weight] = {"row_variance": torch.zeros(48)}
    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(
        ValueError, match=r"layers.1.fc1: optimizer state 'row_variance' has shape \(48,\)"
    ):
        switch_impl(model, "save_factors", opt)
    # refused before anything moved: layers.0 (whose state was fine) is not switched either
    assert [m.impl for m in model.layers] == ["normal", "normal"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if k in before)


def test_a_switch_one_layer_cannot_take_changes_no_layer():
    """chunk 16 divides layers.0's F = 32 but not layers.1's F = 24."""
    model = torch.nn.ModuleList([ParMLP(16, 32, impl="normal"), ParMLP(16, 24, impl="normal")])
    for mlp in model:
        mlp.chunk = 16
    fc1 = model[0].fc1.weight.clone()
    with pytest.raises(ValueError, match="24"):
        switch_impl(model, "save_factors")
    assert [m.impl for m in model] == ["normal", "normal"]
    assert torch.equal(model[0].fc1.weight, fc1)


def test_bare_state_dict_round_trip_is_bit_exact():
    model = TwoLayers()
    state = model.state_dict()
    packed = convert_checkpoint(state, to="packed", chunk=4)
    assert packed["layers.0._extra_state"] == {
        "fc1_layout": {"kind": "packed", "chunk": 4, "tp": 1}
    }
    assert not torch.equal(packed["layers.0.fc1.weight"], state["layers.0.fc1.weight"])
    back = convert_checkpoint(packed, to="canonical")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    loaded = ParMLP(16, 24, bias=True, impl="save_factors", chunk=4)
    loaded.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in packed.items() if k.startswith("layers.0.")}
    )
    x = torch.randn(5, 16)
    torch.testing.assert_close(loaded(x), model.layers[0](x), rtol=1e-6, atol=1e-7)


def test_bad_checkpoints_are_named():
    with pytest.raises(ValueError, match="no ParMLP fc1 weights found"):
        convert_checkpoint({"w": torch.zeros(2)}, to="packed")
    with pytest.raises(ValueError, match="to must be 'packed' or 'canonical'"):
        convert_checkpoint({}, to="interleaved")
    ckpt = {
        "state_dict": TwoLayers().state_dict(),
        "optimizer_states": [{"state": {}, "param_groups": []}],
    }
    with pytest.raises(ValueError, match="no recorded parameter names"):
        convert_checkpoint(ckpt, to="packed")


def test_lightning_checkpoint_converts_and_training_continues(tmp_path):
    """Train with normal, convert model + Adam state to save_factors, continue: the losses are
    those of continuing with normal."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    import shutil
    import textwrap

    for module in (shutil, textwrap):
        (corpus / Path(module.__file__).name).write_bytes(Path(module.__file__).read_bytes())
    with use_backend("torch"):
        cfg = small_config(tmp_path / "base", [str(corpus / "*.py")], "normal", 5)
        cfg.data.val_fraction = 0.0
        run_pretrain(cfg)
        path = Path(cfg.output_dir) / "checkpoints" / "last.ckpt"
        ckpt = torch.load(path, weights_only=False)
        packed = convert_checkpoint(ckpt, to="packed", chunk=32)  # ParMLP's gcd(160, 128)
        round_trip = convert_checkpoint(packed, to="canonical")
        for key, value in ckpt["state_dict"].items():
            assert torch.equal(round_trip["state_dict"][key], value), key
        for a, b in zip(
            ckpt["optimizer_states"][0]["state"].values(),
            round_trip["optimizer_states"][0]["state"].values(),
            strict=True,
        ):
            assert all(torch.equal(a[k], b[k]) for k in a)
        torch.save(packed, tmp_path / "packed.ckpt")
        cfg.train.max_steps = 10
        continued = run_pretrain(cfg, resume=str(path))
        cfg.model.mlp_impl = "save_factors"
        cfg.output_dir = str(tmp_path / "packed")
        converted = run_pretrain(cfg, resume=str(tmp_path / "packed.ckpt"))
    a = [continued["losses"][str(s)] for s in range(5, 10)]
    b = [converted["losses"][str(s)] for s in range(5, 10)]
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)


def test_convert_cli_round_trips_and_refuses_unstamped(tmp_path):
    from typer.testing import CliRunner

    from swiglu_train.cli import app

    runner = CliRunner()
    state = TwoLayers(bias=False).state_dict()  # HF's gated MLP has no biases
    torch.save(state, tmp_path / "canonical.pt")
    refused = runner.invoke(
        app, ["convert", "--to", "packed", str(tmp_path / "canonical.pt"), str(tmp_path / "p.pt")]
    )
    assert refused.exit_code != 0 and "--assume-layout" in refused.output
    assert not (tmp_path / "p.pt").exists()
    ok = runner.invoke(
        app,
        [
            "convert",
            "--to",
            "packed",
            "--chunk",
            "8",
            "--assume-layout",
            "canonical",
            str(tmp_path / "canonical.pt"),
            str(tmp_path / "p.pt"),
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert "layers.0" in ok.output and "packed(chunk=8, tp=1)" in ok.output
    hf = runner.invoke(
        app, ["convert", "--to", "hf", str(tmp_path / "p.pt"), str(tmp_path / "hf.pt")]
    )
    assert hf.exit_code == 0, hf.output
    hf_state = torch.load(tmp_path / "hf.pt")
    assert torch.equal(hf_state["layers.1.gate_proj.weight"], state["layers.1.fc1.weight"][:24])
    assert torch.equal(hf_state["layers.1.up_proj.weight"], state["layers.1.fc1.weight"][24:])
    assert torch.equal(hf_state["layers.1.down_proj.weight"], state["layers.1.fc2.weight"])
    back = runner.invoke(
        app,
        [
            "convert",
            "--to",
            "canonical",
            "--assume-layout",
            "hf",
            str(tmp_path / "hf.pt"),
            str(tmp_path / "back.pt"),
        ],
    )
    assert back.exit_code == 0, back.output
    restored = torch.load(tmp_path / "back.pt")
    assert restored.keys() == state.keys()
    assert all(torch.equal(restored[k], state[k]) for k in state)


def test_convert_report_keeps_brackets_in_paths(tmp_path):
    """Rich reads [..] as a style tag: a path like run[quack]/ must print as it is."""
    from typer.testing import CliRunner

    from swiglu_train.cli import app

    folder = tmp_path / "run[quack]"
    folder.mkdir()
    torch.save(TwoLayers(bias=False).state_dict(), folder / "in.pt")
    args = ["convert", "--to", "packed", "--chunk", "8", "--assume-layout", "canonical"]
    result = CliRunner().invoke(
        app, [*args, str(folder / "in.pt"), str(folder / "out.pt")], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 0, result.output
    assert "run[quack]" in result.output  # unescaped, Rich takes [quack] for a style tag


def adam_checkpoint(model: torch.nn.Module, groups: list[list[str]]) -> dict:
    """A Lightning-style checkpoint of ``model`` after two Adam steps, one optimizer per entry
    of ``groups`` (parameter names), recording the first optimizer's names as PretrainModule
    does."""
    params = dict(model.named_parameters())
    optimizers = [torch.optim.Adam([params[n] for n in names], lr=1e-2) for names in groups]
    for _ in range(2):
        model(torch.randn(5, 16)).backward()
        for opt in optimizers:
            opt.step()
    return {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict() for opt in optimizers],
        "swiglu_train": {
            "fc1_layout": {"kind": "canonical", "chunk": None, "tp": 1},
            "optimizer_param_names": [groups[0]],
        },
    }


@pytest.mark.parametrize(
    ("groups", "names", "message"),
    [
        # names of the first of two optimizers: the second's ids would be read by them
        (
            [["layers.0.fc1.weight", "layers.0.fc2.weight"],
             ["layers.1.fc1.weight", "layers.1.fc2.weight"]],
            None,
            "has 2 optimizer states but swiglu_train.optimizer_param_names names the "
            "parameters of one optimizer",
        ),
        # no names at all for an optimizer with state: its fc1 moments were left unpermuted
        (
            [["layers.0.fc1.weight", "layers.1.fc1.weight"]],
            [],
            r"has groups of \[\] names, but optimizer_states\[0\]'s param groups hold \[2\]",
        ),
    ],
    ids=["two-optimizers", "empty-names"],
)  # fmt: skip
def test_optimizer_state_the_names_do_not_cover_is_refused(groups, names, message):
    torch.manual_seed(0)
    ckpt = adam_checkpoint(TwoLayers(bias=False), groups)
    if names is not None:
        ckpt["swiglu_train"]["optimizer_param_names"] = names
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(ckpt, to="packed", chunk=4)


def test_a_chunk_that_does_not_divide_f_names_the_file_layer_and_sizes(tmp_path):
    from typer.testing import CliRunner

    from swiglu_train.cli import app

    torch.save(TwoLayers().state_dict(), tmp_path / "in.pt")
    args = ["convert", "--to", "packed", "--chunk", "16", "--assume-layout", "canonical"]
    result = CliRunner().invoke(
        app, [*args, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env={"COLUMNS": "400"}
    )
    assert result.exit_code != 0 and not (tmp_path / "out.pt").exists()
    message = " ".join(result.output.replace("│", "").split())
    assert f"{tmp_path / 'in.pt'}: layers.0.fc1.weight [48 rows] cannot go canonical -> " in message
    assert "ffn size 24 is not divisible by chunk=16" in message


def test_per_row_state_hidden_in_a_list_is_refused():
    """A history of moments kept in a list (L-BFGS's, say) would keep the old row order."""
    torch.manual_seed(0)
    ckpt = adam_checkpoint(TwoLayers(bias=False), [["layers.0.fc1.weight"]])
    state = ckpt["optimizer_states"][0]["state"][0]
    state["history"] = [state["exp_avg"].clone()]
    with pytest.raises(
        ValueError, match=r"layers\.0\.fc1\.weight: optimizer state 'history' is a list holding"
    ):
        convert_checkpoint(ckpt, to="packed", chunk=4)


def test_an_output_path_that_is_a_directory_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from swiglu_train.cli import app

    torch.save(TwoLayers().state_dict(), tmp_path / "in.pt")
    (tmp_path / "out").mkdir()
    args = ["convert", "--to", "packed", "--chunk", "4", "--assume-layout", "canonical"]
    result = CliRunner().invoke(
        app, [*args, str(tmp_path / "in.pt"), str(tmp_path / "out")], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 2, result.exception
    assert f"{tmp_path / 'out'} is a directory" in result.output
    assert list((tmp_path / "out").iterdir()) == [] and len(list(tmp_path.iterdir())) == 2


def test_fc1_tied_to_an_entry_convert_does_not_move_is_refused(tmp_path):
    """A twin tied to fc1 would keep the old rows, and whichever loads last wins."""
    model = TwoLayers(bias=False)
    model.tied = torch.nn.Linear(16, 48, bias=False)
    model.tied.weight = model.layers[0].fc1.weight
    torch.save(model.state_dict(), tmp_path / "tied.pt")
    with pytest.raises(ValueError, match=r"layers\.0\.fc1\.weight shares its memory with tied"):
        convert_checkpoint(torch.load(tmp_path / "tied.pt"), to="packed", chunk=4)
    shared = torch.nn.Module()  # one ParMLP in two places: both fc1 move alike, round trip
    shared.layers = torch.nn.ModuleList([model.layers[1], model.layers[1]])
    torch.save(shared.state_dict(), tmp_path / "shared.pt")
    state = torch.load(tmp_path / "shared.pt")
    back = convert_checkpoint(convert_checkpoint(state, to="packed", chunk=4), to="canonical")
    assert all(torch.equal(back[k], state[k]) for k in state)
