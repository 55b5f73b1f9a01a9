"""`convert` reads the layout a checkpoint records, refuses assumptions that contradict it, and
leaves the converted checkpoint recording its new layout."""

import shutil
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_pretrain import small_config
from typer.testing import CliRunner

from swiglu_train import ParMLP
from swiglu_train.cli import app
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.module import PretrainModule
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.layers.layout import CANONICAL, Layout, packed_order
from swiglu_train.ops import use_backend
from swiglu_train.packing import convert_checkpoint, from_hf, to_hf

ROWS, CHUNK = 320, 32  # small_config's fc1 (2 x 160 rows); save_factors packs it by 32
PACKED = Layout("packed", CHUNK)
MLPS = ("model.layers.0.mlp.", "model.layers.1.mlp.")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, Path]:
    """last.ckpt of a two-step `pretrain` per impl: drop_h (canonical), save_factors (packed)."""
    root = tmp_path_factory.mktemp("pretrained")
    corpus = root / "corpus"
    corpus.mkdir()
    for module in (shutil, textwrap):
        (corpus / Path(module.__file__).name).write_bytes(Path(module.__file__).read_bytes())
    paths = {}
    with use_backend("torch"):
        for impl in ("drop_h", "save_factors"):
            cfg = small_config(root, [str(corpus / "*.py")], impl, 2)
            cfg.data.val_fraction, cfg.train.checkpoint_every = 0.0, 2
            run_pretrain(cfg)
            paths[impl] = Path(cfg.output_dir) / "checkpoints" / "last.ckpt"
    return paths


def invoke(*args: object):
    return CliRunner().invoke(app, ["convert", *map(str, args)], env={"COLUMNS": "400"})


def load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def unpacked(fc1: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Canonical rows of a packed fc1, by the definition ``packed = canonical[packed_order]``."""
    canonical = torch.empty_like(fc1)
    canonical[packed_order(fc1.shape[0], layout.chunk, layout.tp)] = fc1
    return canonical


def fc1_state(ckpt: dict, prefix: str) -> list[torch.Tensor]:
    """The optimizer's per-element state of one fc1 weight, through the recorded names."""
    names = [n for group in ckpt["swiglu_train"]["optimizer_param_names"] for n in group]
    opt = ckpt["optimizer_states"][0]
    ids = [i for group in opt["param_groups"] for i in group["params"]]
    state = opt["state"][ids[names.index(prefix + "fc1.weight")]]
    return [state["exp_avg"], state["exp_avg_sq"]]


def test_pretrain_checkpoint_converts_by_its_record_and_records_the_new_layout(
    pretrained, tmp_path
):
    src, packed_path, back_path = pretrained["drop_h"], tmp_path / "p.ckpt", tmp_path / "c.ckpt"
    original = load(src)
    assert original["swiglu_train"]["fc1_layout"] == CANONICAL.to_dict()
    assert not any(k.endswith("_extra_state") for k in original["state_dict"])

    ok = invoke("--to", "packed", "--chunk", CHUNK, src, packed_path)
    assert ok.exit_code == 0, ok.output
    packed = load(packed_path)
    assert packed["swiglu_train"]["fc1_layout"] == PACKED.to_dict()
    index = packed_order(ROWS, CHUNK)
    for prefix in MLPS:
        assert packed["state_dict"][prefix + "_extra_state"] == {"fc1_layout": PACKED.to_dict()}
        fc1 = original["state_dict"][prefix + "fc1.weight"]
        assert torch.equal(packed["state_dict"][prefix + "fc1.weight"], fc1[index])
        for new, old in zip(fc1_state(packed, prefix), fc1_state(original, prefix), strict=True):
            assert torch.equal(new, old[index])

    # The converted file is read by its own record: back without --assume-layout, bit-exact.
    ok = invoke("--to", "canonical", packed_path, back_path)
    assert ok.exit_code == 0, ok.output
    back = load(back_path)
    assert back["swiglu_train"]["fc1_layout"] == CANONICAL.to_dict()
    assert back["state_dict"].keys() == original["state_dict"].keys()
    for key, value in original["state_dict"].items():
        assert torch.equal(back["state_dict"][key], value), key

    # And a save_factors model resumes from the packed file computing drop_h's function.
    cfg = small_config(tmp_path, None, "save_factors", 2)
    module = PretrainModule(cfg.model, cfg.optim, 2)
    module.on_load_checkpoint(packed)  # refuses a record unlike the model's layout
    module.load_state_dict(packed["state_dict"])
    reference = PretrainModule(replace(cfg.model, mlp_impl="drop_h"), cfg.optim, 2)
    reference.load_state_dict(original["state_dict"])
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with torch.no_grad(), use_backend("torch"):
        torch.testing.assert_close(module.model(tokens), reference.model(tokens))


def test_converted_checkpoint_names_no_impl_of_another_layout(pretrained, tmp_path):
    """`mlp_impl` must not name an impl whose fc1 layout the converted file no longer has;
    several impls share each layout, so a stale name is dropped and the conversion recorded."""
    src = pretrained["save_factors"]
    assert load(src)["swiglu_train"]["mlp_impl"] == "save_factors"
    ok = invoke("--to", "canonical", src, tmp_path / "c.ckpt")
    assert ok.exit_code == 0, ok.output
    record = load(tmp_path / "c.ckpt")["swiglu_train"]
    assert record["fc1_layout"] == CANONICAL.to_dict()
    assert "mlp_impl" not in record
    assert record["converted"] == [
        {"from_fc1_layout": PACKED.to_dict(), "to_fc1_layout": CANONICAL.to_dict(),
         "mlp_impl": "save_factors"}
    ]  # fmt: skip

    # Back to packed: still no name (save_factors reads it, but did not save it); history grows.
    packed = convert_checkpoint(load(tmp_path / "c.ckpt"), to="packed", chunk=16)["swiglu_train"]
    assert "mlp_impl" not in packed
    assert [c["to_fc1_layout"] for c in packed["converted"]] == [
        CANONICAL.to_dict(),
        Layout("packed", 16).to_dict(),
    ]

    # drop_h's file packed: drop_h does not read packed fc1, so its name goes too.
    record = convert_checkpoint(load(pretrained["drop_h"]), to="packed", chunk=CHUNK)
    assert "mlp_impl" not in record["swiglu_train"]
    assert record["swiglu_train"]["converted"][0]["mlp_impl"] == "drop_h"


@pytest.mark.parametrize(
    ("impl", "to", "chunk", "converted"),
    [
        ("drop_h", "canonical", None, False),  # nothing moves
        ("save_factors", "packed", CHUNK, False),
        ("save_factors", "packed", 16, True),  # save_factors reads any chunk
    ],
)
def test_impl_name_that_still_fits_the_layout_is_kept(pretrained, impl, to, chunk, converted):
    record = convert_checkpoint(load(pretrained[impl]), to=to, chunk=chunk)["swiglu_train"]
    assert record["mlp_impl"] == impl
    assert ("converted" in record) == converted


def test_a_stale_name_from_an_earlier_convert_is_dropped(pretrained):
    """A file converted before the name was checked (canonical fc1 labelled save_factors) is
    mended by converting it again, even where no row moves."""
    stale = convert_checkpoint(load(pretrained["save_factors"]), to="canonical")
    stale["swiglu_train"]["mlp_impl"] = "save_factors"
    del stale["swiglu_train"]["converted"]
    record = convert_checkpoint(stale, to="canonical")["swiglu_train"]
    assert "mlp_impl" not in record
    assert record["converted"] == [
        {"from_fc1_layout": CANONICAL.to_dict(), "to_fc1_layout": CANONICAL.to_dict(),
         "mlp_impl": "save_factors"}
    ]  # fmt: skip


def test_converted_checkpoint_resumes_with_an_impl_of_its_layout(pretrained, tmp_path):
    """`pretrain --resume` reads the converted record (layout, no impl name) and trains on."""
    ok = invoke("--to", "canonical", pretrained["save_factors"], tmp_path / "c.ckpt")
    assert ok.exit_code == 0, ok.output
    corpus = pretrained["save_factors"].parents[2] / "corpus"
    cfg = small_config(tmp_path, [str(corpus / "*.py")], "normal", 3)
    cfg.data.val_fraction = 0.0
    with use_backend("torch"):
        resumed = run_pretrain(cfg, resume=str(tmp_path / "c.ckpt"))
    assert resumed["steps"] == 3 and resumed["mlp_impl"] == "normal"


@pytest.mark.parametrize(
    ("impl", "assumed", "recorded"),
    [
        ("drop_h", "packed:64", "canonical"),
        ("save_factors", "canonical", str(PACKED)),
        ("save_factors", "packed:64", str(PACKED)),
    ],
)
def test_assumption_contradicting_the_record_is_refused(
    pretrained, tmp_path, impl, assumed, recorded
):
    refused = invoke(
        "--to",
        "packed",
        "--chunk",
        16,
        "--assume-layout",
        assumed,
        pretrained[impl],
        tmp_path / "out.ckpt",
    )
    assert refused.exit_code != 0
    assumed_str = "canonical" if assumed == "canonical" else "packed(chunk=64, tp=1)"
    for name in (str(pretrained[impl]), recorded, assumed_str):
        assert name in refused.output, (name, refused.output)
    assert not (tmp_path / "out.ckpt").exists()
    with pytest.raises(ValueError, match="is recorded as"):
        convert_checkpoint(
            load(pretrained[impl]), to="canonical", assume_layout=Layout("packed", 64)
        )


@pytest.mark.parametrize(
    ("impl", "assumed"), [("drop_h", "canonical"), ("save_factors", f"packed:{CHUNK}")]
)
def test_assumption_agreeing_with_the_record_is_fine(pretrained, tmp_path, impl, assumed):
    ok = invoke(
        "--to", "canonical", "--assume-layout", assumed, pretrained[impl], tmp_path / "c.ckpt"
    )
    assert ok.exit_code == 0, ok.output
    original, out = load(pretrained[impl])["state_dict"], load(tmp_path / "c.ckpt")["state_dict"]
    source = CANONICAL if impl == "drop_h" else PACKED
    for prefix in MLPS:
        fc1 = original[prefix + "fc1.weight"]
        expected = fc1 if source == CANONICAL else unpacked(fc1, source)
        assert torch.equal(out[prefix + "fc1.weight"], expected)


def test_stamp_and_record_that_disagree_are_refused(pretrained):
    ckpt = load(pretrained["save_factors"])
    ckpt["swiglu_train"]["fc1_layout"] = CANONICAL.to_dict()
    with pytest.raises(ValueError, match="contradicts itself"):
        convert_checkpoint(ckpt, to="canonical")


@pytest.mark.parametrize("chunk", [0, -4])
def test_non_positive_chunk_is_refused(tmp_path, chunk):
    state = ParMLP(16, 128, impl="normal").state_dict()  # 128 rows per half: the default fits
    torch.save(state, tmp_path / "c.pt")
    refused = invoke(
        "--to",
        "packed",
        "--chunk",
        chunk,
        "--assume-layout",
        "canonical",
        tmp_path / "c.pt",
        tmp_path / "p.pt",
    )
    assert refused.exit_code != 0 and "positive" in refused.output and "--chunk" in refused.output
    assert not (tmp_path / "p.pt").exists()
    with pytest.raises(ValueError, match=f"chunk must be a positive number of rows, got {chunk}"):
        convert_checkpoint(state, to="packed", chunk=chunk)
    default = convert_checkpoint(state, to="packed")  # no chunk given: 128
    assert torch.equal(default["fc1.weight"], state["fc1.weight"][packed_order(256, 128)])


def test_chunk_without_a_packed_target_is_refused(tmp_path):
    torch.save(ParMLP(16, 128, impl="normal").state_dict(), tmp_path / "c.pt")
    args = ("--chunk", 64, "--assume-layout", "canonical", tmp_path / "c.pt", tmp_path / "o.pt")
    for to in ("canonical", "hf"):
        refused = invoke("--to", to, *args)
        assert refused.exit_code != 0 and "applies to --to packed only" in refused.output
    assert not (tmp_path / "o.pt").exists()


def test_to_hf_takes_a_lightning_checkpoint(pretrained, tmp_path):
    src = pretrained["save_factors"]
    ok = invoke("--to", "hf", src, tmp_path / "hf.pt")
    assert ok.exit_code == 0, ok.output
    packed = load(src)["state_dict"]
    hf = torch.load(tmp_path / "hf.pt")  # a bare state_dict: weights only
    assert not {"optimizer_states", "state_dict", "swiglu_train"} & hf.keys()
    assert not any(k.endswith(("_extra_state", "fc1.weight")) for k in hf)
    for prefix in MLPS:
        fc1 = unpacked(packed[prefix + "fc1.weight"], PACKED)
        assert torch.equal(hf[prefix + "gate_proj.weight"], fc1[: ROWS // 2])
        assert torch.equal(hf[prefix + "up_proj.weight"], fc1[ROWS // 2 :])
        assert torch.equal(hf[prefix + "down_proj.weight"], packed[prefix + "fc2.weight"])
    rows = [line for line in ok.output.splitlines() if "model.layers.0.mlp" in line]
    assert len(rows) == 1 and rows[0].split("│")[3].strip() == "hf", ok.output
    report = []
    to_hf(load(src), report)
    assert [(r.source, r.target) for r in report] == [(str(PACKED), "hf")] * 2


def _bare(impls: tuple[str, str]) -> dict:
    """A bare state_dict of two ParMLPs (16 -> 2x24 rows) in these impls' layouts."""
    layers = torch.nn.ModuleList(ParMLP(16, 24, impl=i, chunk=8) for i in impls)
    return layers.state_dict()


def test_a_megatron_stamp_beside_linear_fc1_is_refused_not_ignored():
    """Megatron names the weights linear_fc1/linear_fc2 and stamps the MLP module: convert must
    not read those packed rows as unstamped canonical ones."""
    state = _bare(("save_factors", "save_factors"))
    megatron = {}
    for i in (0, 1):
        mlp = f"decoder.layers.{i}.mlp."
        megatron[mlp + "linear_fc1.weight"] = state[f"{i}.fc1.weight"]
        megatron[mlp + "linear_fc2.weight"] = state[f"{i}.fc2.weight"]
        megatron[mlp + "_extra_state"] = state[f"{i}._extra_state"]
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\._extra_state records an fc1"):
        convert_checkpoint(megatron, to="canonical")


def test_another_module_s_extra_state_records_no_layout(tmp_path):
    """A foreign _extra_state (Transformer Engine keeps one) is no layout stamp: an unstamped
    file still needs --assume-layout."""
    state = _bare(("normal", "normal"))
    state["0.norm._extra_state"] = torch.zeros(3)
    torch.save(state, tmp_path / "in.pt")
    result = invoke("--to", "packed", "--chunk", "8", tmp_path / "in.pt", tmp_path / "out.pt")
    assert result.exit_code != 0 and "--assume-layout" in result.output
    assert not (tmp_path / "out.pt").exists()


def test_an_unstamped_sibling_of_a_stamped_fc1_is_canonical():
    """ParMLP loads an unstamped fc1 as canonical, so in a file with stamps, assuming packed
    for the unstamped one contradicts what the file records."""
    state = _bare(("normal", "save_factors"))
    with pytest.raises(ValueError, match=r"0\.fc1 is recorded as canonical but assumed"):
        convert_checkpoint(state, to="canonical", assume_layout=Layout("packed", 8))
    converted = convert_checkpoint(state, to="packed", chunk=8)
    assert torch.equal(converted["1.fc1.weight"], state["1.fc1.weight"])  # already packed by 8
    assert torch.equal(converted["0.fc1.weight"], state["0.fc1.weight"][packed_order(48, 8, 1)])


def _hf(f_gate: int = 24, f_up: int = 24, f_down: int = 24) -> dict:
    return {
        "m.gate_proj.weight": torch.randn(f_gate, 16),
        "m.up_proj.weight": torch.randn(f_up, 16),
        "m.down_proj.weight": torch.randn(16, f_down),
    }


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (_hf(f_up=40), r"m\.: expected gate_proj and up_proj \[F, D\] and down_proj \[O, F\]"),
        (_hf(f_down=32), r"with one F; got .*'down_proj': \(16, 32\)"),
        (_hf() | {"m.gate_proj.bias": torch.zeros(24)}, r"HF MLP biases \(m\.gate_proj\.bias\)"),
        (_hf() | {"m.fc1.weight": torch.zeros(48, 16)}, r"already holds \['m\.fc1\.weight'\]"),
        (_hf() | {"m.up_proj.weight": [[0.0]]}, r"HF weights must be tensors; got \{'up_proj'"),
    ],
)
def test_from_hf_refuses_what_would_load_wrong(state, message):
    """Mismatched sizes would concatenate into an fc1 a ParMLP of another F loads without error,
    with gate rows taken from up_proj; biases would be dropped by a non-strict load."""
    with pytest.raises(ValueError, match=message):
        from_hf(state)


def test_from_hf_builds_the_canonical_fc1():
    state = _hf()
    out = from_hf(state)
    assert torch.equal(out["m.fc1.weight"][:24], state["m.gate_proj.weight"])
    assert torch.equal(out["m.fc1.weight"][24:], state["m.up_proj.weight"])
    assert torch.equal(out["m.fc2.weight"], state["m.down_proj.weight"])


@pytest.mark.parametrize("trust", [False, True])
def test_a_damaged_file_is_named_as_such_not_as_unsafe(tmp_path, trust):
    """An empty or truncated file is not a pickling question: --trust would not help."""
    (tmp_path / "empty.ckpt").write_bytes(b"")
    args = ["--to", "canonical", "--assume-layout", "canonical", *(["--trust"] if trust else [])]
    result = invoke(*args, tmp_path / "empty.ckpt", tmp_path / "out.pt")
    assert result.exit_code != 0
    assert "empty.ckpt is empty (0 bytes), not a checkpoint" in result.output
    assert "--trust" not in result.output.replace("--trust]", "")


# Converting a Lightning checkpoint retargets the impl its saved init args name, so that
# `load_from_checkpoint` builds a model that takes the new layout (see fit_hparams_impl).


def original_and_converted(pretrained, tmp_path, impl: str, to: str, chunk: int | None):
    """(original path, converted path), converted through the CLI as a user would."""
    dst = tmp_path / "converted.ckpt"
    ok = invoke("--to", to, *(["--chunk", chunk] if chunk else []), pretrained[impl], dst)
    assert ok.exit_code == 0, ok.output
    return pretrained[impl], dst


@pytest.mark.parametrize(
    ("impl", "to", "chunk", "loads_as"),
    [
        ("drop_h", "packed", CHUNK, "save_factors"),  # drop_h would build canonical fc1
        ("save_factors", "canonical", None, "drop_h"),  # save_factors would build packed fc1
        ("save_factors", "packed", CHUNK, "save_factors"),  # still fits: kept
        ("drop_h", "canonical", None, "drop_h"),
    ],
)
def test_converted_checkpoint_loads_from_checkpoint_into_an_impl_of_its_layout(
    pretrained, tmp_path, impl, to, chunk, loads_as
):
    """Before, the saved init args still named the saving impl: load_from_checkpoint built the
    old layout and refused the file (LayoutMismatchError, suggesting a convert back)."""
    src, dst = original_and_converted(pretrained, tmp_path, impl, to, chunk)
    before, after = load(src)["hyper_parameters"], load(dst)["hyper_parameters"]
    assert after["model"].pop("mlp_impl") == loads_as
    assert before["model"].pop("mlp_impl") == impl
    assert after["model"].pop("mlp_chunk") == (CHUNK if to == "packed" else None)
    assert before["model"].pop("mlp_chunk") is None  # pretrain's default chunk
    assert after == before  # all else in the init args is untouched

    with use_backend("torch"):
        original = PretrainModule.load_from_checkpoint(src)
        converted = PretrainModule.load_from_checkpoint(dst)
        mlp = converted.model.layers[0].mlp
        assert mlp.impl == loads_as
        assert mlp.fc1_layout == (PACKED if to == "packed" else CANONICAL)
        tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = converted.loss(tokens)
        torch.testing.assert_close(loss, original.loss(tokens))
        loss.backward()
    fc1 = [m.mlp.fc1.weight for m in converted.model.layers]
    assert all(w.grad is not None and w.grad.abs().sum() > 0 for w in fc1)


def test_converted_checkpoint_resumes_in_lightning_from_its_own_init_args(pretrained, tmp_path):
    """A Lightning-native resume (model from load_from_checkpoint, fit with ckpt_path) of a
    file converted to packed takes the same step as resuming the canonical original: weights
    and Adam moments were permuted together and the rebuilt impl reads the new layout."""
    from lightning.pytorch import Trainer, seed_everything

    from swiglu_train.integrations.lightning.data import PackedTextData

    src, dst = original_and_converted(pretrained, tmp_path, "drop_h", "packed", CHUNK)
    corpus = src.parents[2] / "corpus"
    cfg = small_config(tmp_path, [str(corpus / "*.py")], "drop_h", 3)
    cfg.data.val_fraction = 0.0
    stepped = {}
    with use_backend("torch"):
        for path in (src, dst):
            seed_everything(0)
            module = PretrainModule.load_from_checkpoint(path, max_steps=3)
            data = PackedTextData(cfg.data, cfg.model.vocab_size)
            trainer = Trainer(
                max_steps=3,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                use_distributed_sampler=False,
                num_sanity_val_steps=0,
            )
            trainer.fit(module, datamodule=data, ckpt_path=str(path))
            assert trainer.global_step == 3
            stepped[path] = module
    assert stepped[dst].model.layers[0].mlp.impl == "save_factors"
    reference = stepped[src].state_dict()
    for key, value in stepped[dst].state_dict().items():
        if key.endswith("fc1.weight"):
            value = unpacked(value, PACKED)
        if not key.endswith("_extra_state"):
            torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-7, msg=key)


def test_auto_in_the_init_args_is_pinned_to_the_impl_it_resolved_to(pretrained):
    """auto resolves per machine (a GPU's table, or drop_h on CPU), so it could rebuild another
    layout than the file's; convert names the resolved impl the record keeps."""
    ckpt = load(pretrained["save_factors"])
    ckpt["hyper_parameters"]["model"]["mlp_impl"] = "auto"  # as a GPU run with auto saves it
    out = convert_checkpoint(ckpt, to="packed", chunk=CHUNK)
    assert out["hyper_parameters"]["model"]["mlp_impl"] == "save_factors"
    out = convert_checkpoint(ckpt, to="canonical")
    assert out["hyper_parameters"]["model"]["mlp_impl"] == "drop_h"


@pytest.mark.parametrize("chunk", [1, 16, 80])
def test_a_file_converted_to_any_chunk_loads_from_checkpoint_and_back(pretrained, tmp_path, chunk):
    """convert records the chunk as model.mlp_chunk, so load_from_checkpoint builds save_factors
    packed by it. Before, a chunk other than save_factors' default (32 here) was refused with a
    convert back to 32, and chunk 1 named save_factors_quack, which needs quack on a GPU."""
    src, dst = original_and_converted(pretrained, tmp_path, "drop_h", "packed", chunk)
    model = load(dst)["hyper_parameters"]["model"]
    assert (model["mlp_impl"], model["mlp_chunk"]) == ("save_factors", chunk)
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with use_backend("torch"):
        original = PretrainModule.load_from_checkpoint(src)
        converted = PretrainModule.load_from_checkpoint(dst)
        assert converted.model.layers[0].mlp.fc1_layout == Layout("packed", chunk)
        loss = converted.loss(tokens)
        torch.testing.assert_close(loss, original.loss(tokens))
        loss.backward()
    assert all(m.mlp.fc1.weight.grad.abs().sum() > 0 for m in converted.model.layers)

    back = tmp_path / "back.ckpt"
    ok = invoke("--to", "canonical", dst, back)
    assert ok.exit_code == 0, ok.output
    assert f"model.mlp_chunk: {chunk} -> None" in ok.output
    model = load(back)["hyper_parameters"]["model"]
    assert (model["mlp_impl"], model["mlp_chunk"]) == ("drop_h", None)  # the chunk is cleared
    with use_backend("torch"):
        canonical = PretrainModule.load_from_checkpoint(back)
        assert canonical.model.layers[0].mlp.fc1_layout == CANONICAL
        torch.testing.assert_close(canonical.loss(tokens), original.loss(tokens))


def test_save_factors_quack_keeps_chunk_one_and_leaves_any_other(pretrained):
    """save_factors_quack builds chunk 1 only: kept (with mlp_chunk 1, which its config takes)
    for chunk 1, replaced by save_factors for another chunk (a chunk it would refuse)."""
    ckpt = load(pretrained["save_factors"])
    ckpt["hyper_parameters"]["model"]["mlp_impl"] = "save_factors_quack"
    del ckpt["swiglu_train"]["mlp_impl"]
    for chunk, impl in ((1, "save_factors_quack"), (16, "save_factors")):
        model = convert_checkpoint(ckpt, to="packed", chunk=chunk)["hyper_parameters"]["model"]
        assert (model["mlp_impl"], model["mlp_chunk"]) == (impl, chunk)
        ModelConfig(**model)  # a config the pretrain recipe accepts


def test_an_older_checkpoint_without_a_chunk_loads_and_converts_as_before(pretrained, tmp_path):
    """Init args saved before model.mlp_chunk existed build the impl's default chunk; convert
    adds the key only where it packs."""
    ckpt = load(pretrained["save_factors"])
    del ckpt["hyper_parameters"]["model"]["mlp_chunk"]
    torch.save(ckpt, tmp_path / "old.ckpt")
    with use_backend("torch"):
        module = PretrainModule.load_from_checkpoint(tmp_path / "old.ckpt")
    assert module.model_cfg.mlp_chunk is None and module.model.layers[0].mlp.fc1_layout == PACKED
    canonical = convert_checkpoint(ckpt, to="canonical")["hyper_parameters"]["model"]
    assert "mlp_chunk" not in canonical and canonical["mlp_impl"] == "drop_h"
    packed = convert_checkpoint(ckpt, to="packed", chunk=16)["hyper_parameters"]["model"]
    assert packed["mlp_chunk"] == 16
