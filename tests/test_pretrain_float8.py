"""`swiglu-train pretrain --float8 tensorwise|rowwise` (model.float8): what it refuses, in one
line with exit code 2 before any work, and which linears it converts to torchao's Float8Linear.
The run itself needs a GPU with FP8; the converted model trains a step on the CPU here."""

import sys

import pytest
import torch
from patch_models import hf_config
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from swiglu_train.cli import app
from swiglu_train.cli.app import DEBUG_ENV
from swiglu_train.extras import missing_extra_line
from swiglu_train.integrations.lightning import float8
from swiglu_train.integrations.lightning.float8 import check_float8_run
from swiglu_train.integrations.lightning.model import ModelConfig
from swiglu_train.integrations.lightning.module import OptimConfig, PretrainModule
from swiglu_train.ops import use_backend

IMPL_REFUSED = (
    "model.float8='rowwise' (--float8): mlp_impl 'save_factors' runs GEMMs of its own, whose "
    "FP8 versions are not implemented yet; use --mlp-impl drop_h or normal, which run torchao's "
    "Float8Linear recipes"
)


@pytest.fixture
def entry(monkeypatch, capsys):
    """``swiglu-train ARGS``: (exit code, stderr)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def run(*args: object) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_:
            app(args=[str(a) for a in args], prog_name="swiglu-train")
        return exit_.value.code, capsys.readouterr().err

    return run


def test_the_config_refuses_what_has_no_fp8_gemms_yet():
    assert ModelConfig(mlp_impl="normal", float8="tensorwise").float8 == "tensorwise"
    assert ModelConfig(float8="rowwise").float8 == "rowwise"  # the default impl, drop_h
    with pytest.raises(ValueError) as e:
        ModelConfig(mlp_impl="save_factors", float8="rowwise")
    assert str(e.value) == IMPL_REFUSED
    with pytest.raises(ValueError, match="mlp_impl 'auto' runs GEMMs of its own"):
        ModelConfig(mlp_impl="auto", float8="rowwise")
    with pytest.raises(ValueError, match=r"^model.float8='fp4' \(--float8\) must be one of "):
        ModelConfig(mlp_impl="normal", float8="fp4")
    with pytest.raises(ValueError, match="MLPs are 4 routed experts, whose FP8 GEMMs are not"):
        ModelConfig(mlp_impl="normal", float8="rowwise", num_experts=4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--float8", "rowwise", "--mlp-impl", "save_factors"], IMPL_REFUSED),
        (["--float8", "e5m2", "--mlp-impl", "normal"], "must be one of tensorwise, rowwise"),
        (
            ["--float8", "rowwise", "--mlp-impl", "normal", "--activation-checkpointing", "auto"],
            "the planner (--activation-checkpointing auto) measures bf16 runs only",
        ),
        pytest.param(
            ["--float8", "tensorwise", "--mlp-impl", "normal"],
            "needs a CUDA GPU with FP8, compute capability 8.9+ (Ada, Hopper or newer); this "
            "run trains on the CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the answer without CUDA"),
        ),
    ],
)
def test_the_flag_is_refused_in_one_line_before_any_work(entry, tmp_path, args, message):
    code, err = entry("pretrain", *args, "--output-dir", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(float8, "device_capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.9\+ .*; cuda:0 is 8\.0$"):
        check_float8_run("rowwise", "manual", 0)
    monkeypatch.setattr(float8, "device_capability", lambda index: (9, 0))
    check_float8_run("rowwise", "manual", 0)  # an H100 or H200


@pytest.mark.parametrize("impl", ["normal", "drop_h"])
@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_every_linear_but_the_head_is_converted_and_trains(recipe, impl):
    cfg = ModelConfig(mlp_impl=impl, float8=recipe, compile_blocks=False)
    torch.manual_seed(0)
    module = PretrainModule(cfg, OptimConfig(), max_steps=10)
    torch.manual_seed(0)
    plain = PretrainModule(ModelConfig(mlp_impl=impl), OptimConfig(), max_steps=10)
    linears = {n: type(m) for n, m in module.model.named_modules() if isinstance(m, nn.Linear)}
    per_block = ("attn.qkv", "attn.out", "mlp.fc1", "mlp.fc2")
    assert linears == {
        **{f"layers.{i}.{n}": Float8Linear for i in range(cfg.num_layers) for n in per_block},
        "head": nn.Linear,
    }
    assert all(m.config == module.model.layers[0].mlp.fc1.config for m in module.model.modules()
               if isinstance(m, Float8Linear))  # fmt: skip
    state = module.state_dict()  # same keys and values: a checkpoint resumes either way
    assert state.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in state.items())
    calls = []
    module.model.layers[0].mlp.fc2.register_forward_hook(lambda *args: calls.append(1))
    rows = torch.randint(0, cfg.vocab_size, (2, 33))
    with use_backend("torch"):
        loss = module.loss(rows)
        loss.backward()
        baseline = plain.loss(rows)
    # normal: the MLP's GEMMs are Float8Linear's; drop_h: its own, cast by their recipe
    assert calls == ([1] if impl == "normal" else [])
    assert torch.isfinite(loss) and loss.item() != baseline.item()
    assert module.model.layers[0].mlp.fc1.weight.grad is not None


def test_float8_compiles_each_block_unless_told_not_to():
    """torchao's casts are unfused eager kernels: FP8 drop_h ran 2.4-3.8x the bf16 floor on the
    H100 uncompiled, torchao's compiled MLP 0.75-1.0x. Keys and module types stay put."""
    blocks = lambda cfg: PretrainModule(cfg, OptimConfig(), max_steps=10).model.layers  # noqa: E731
    assert all(b._compiled_call_impl is not None for b in blocks(ModelConfig(float8="rowwise")))
    off = ModelConfig(float8="rowwise", compile_blocks=False)
    assert all(b._compiled_call_impl is None for b in blocks(off))
    assert all(b._compiled_call_impl is None for b in blocks(ModelConfig()))


def test_a_compiled_block_trains_as_the_eager_one():
    torch.manual_seed(0)
    compiled = PretrainModule(ModelConfig(compile_blocks=True), OptimConfig(), max_steps=10)
    torch.manual_seed(0)
    eager = PretrainModule(ModelConfig(), OptimConfig(), max_steps=10)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    rows = torch.randint(0, 320, (2, 33))
    with use_backend("torch"):
        losses = [m.loss(rows) for m in (compiled, eager)]
        for loss in losses:
            loss.backward()
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-5)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_host_model_is_patched_to_normal_then_converted(tmp_path):
    config = hf_config("llama")
    config.vocab_size = 320  # the byte-level data's ids, padded to a multiple of 64
    config.save_pretrained(tmp_path)
    cfg = ModelConfig(source=f"hf:{tmp_path}", mlp_impl="normal", float8="tensorwise")
    model = PretrainModule(cfg, OptimConfig(), max_steps=10).model
    assert type(model.host.lm_head) is nn.Linear
    assert isinstance(model.layers[0].mlp.fc1, Float8Linear)
    assert isinstance(model.layers[0].self_attn.q_proj, Float8Linear)


def test_a_linear_fp8_gemms_cannot_take_is_refused_not_left_in_bf16():
    cfg = ModelConfig(hidden_size=72, ffn_hidden_size=160, num_heads=2, mlp_impl="normal",
                      float8="rowwise")  # fmt: skip
    with pytest.raises(ValueError) as e:
        PretrainModule(cfg, OptimConfig(), max_steps=10)
    assert str(e.value) == (
        "--float8: layers.0.attn.qkv is [216, 72], but FP8 GEMMs need both dims divisible by "
        "16; pick sizes that are"
    )


def test_without_torchao_the_flag_names_the_extra(entry, monkeypatch, tmp_path):
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # `import torchao` fails as if absent
    monkeypatch.setitem(sys.modules, "torchao", None)
    code, err = entry("pretrain", "--float8", "rowwise", "--output-dir", tmp_path / "run")
    assert code == 1 and err == f"error: {missing_extra_line('torchao')}\n"
    assert "[fp8] extra" in err and not (tmp_path / "run").exists()
