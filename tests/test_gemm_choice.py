"""The quack impls' per-shape GEMM library choice: the cache, its keys and defaults, the
pretune decision, and the command's refusals (the timing itself runs on the GPU)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from swiglu_train.bench.pretune import measure as pretune
from swiglu_train.cli import app
from swiglu_train.ops import gemm_choice

ROOT = Path(__file__).resolve().parents[1]

H200 = "NVIDIA H200"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIGLU_TRAIN_CACHE_DIR", str(tmp_path))
    gemm_choice.forget()
    yield tmp_path
    gemm_choice.forget()


H200_SMS = 132


def test_without_a_cache_every_gemm_keeps_its_default():
    for gemm, default in gemm_choice.DEFAULTS.items():
        assert gemm_choice.choice(gemm, 8000, 4096, 11008, torch.bfloat16, H200, H200_SMS) == (
            default
        )
    # the library that won at most of the grid's shapes (probe_gemm_defaults_h200.json, and
    # the dynamic schedule from grid_pretune_m8000_h200.json)
    assert gemm_choice.DEFAULTS == {
        "fc2": "cublas", "grad_w2": "quack", "grad_x_packed": "cublas",
        "grad_w1_packed": "quack_dynamic", "grad_x_concat": "quack_dynamic",
        "grad_w1_concat": "quack_dynamic",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("o", "f", "sms", "expected"),
    [
        (896, 4864, H200_SMS, "cublas"),  # Qwen2.5-0.5B: 133 tiles, 1.0 wave
        (2048, 8192, H200_SMS, "cublas"),  # Llama-3.2-1B: 512 tiles, 3.9 waves
        (2560, 9728, H200_SMS, "quack"),  # 760 tiles, 5.8 waves
        (2560, 9728, 160, "cublas"),  # the same output on a GPU with more SMs: 4.75 waves
        (4096, 14336, H200_SMS, "quack"),
    ],
)
def test_grad_w2_s_default_follows_the_waves_its_output_fills(o, f, sms, expected):
    """grad_W2's [O, F] output: cuBLAS under SPLIT_K_WAVES waves of 128x256 tiles, else quack;
    the rule reads the GPU's SM count, not a shape table. The other GEMMs keep their default."""
    assert gemm_choice.default("grad_w2", o, f, sms) == expected
    assert gemm_choice.choice("grad_w2", o, f, 8000, torch.bfloat16, H200, sms) == expected
    assert gemm_choice.default("grad_w1_packed", 2 * f, o, sms) == "quack_dynamic"
    assert gemm_choice.output_waves(2048, 8192, H200_SMS) == pytest.approx(512 / 132)


def test_a_recorded_choice_holds_for_that_gemm_gpu_dtype_and_shape_only(cache_dir):
    k = gemm_choice.key("grad_w2", 8000, 4096, 11008, torch.bfloat16, H200)
    path = gemm_choice.record({k: {"backend": "cublas", "quack_ms": 1.15, "cublas_ms": 1.10}})
    assert path == cache_dir / "gemm_choices.json"
    assert (
        gemm_choice.choice("grad_w2", 8000, 4096, 11008, torch.bfloat16, H200, H200_SMS) == "cublas"
    )
    assert (
        gemm_choice.choice("grad_w2", 8001, 4096, 11008, torch.bfloat16, H200, H200_SMS) == "quack"
    )
    assert (
        gemm_choice.choice("grad_w2", 8000, 4096, 11008, torch.float16, H200, H200_SMS) == "quack"
    )
    h100 = "NVIDIA H100"
    assert (
        gemm_choice.choice("grad_w2", 8000, 4096, 11008, torch.bfloat16, h100, H200_SMS) == "quack"
    )
    assert gemm_choice.choice("fc2", 8000, 4096, 11008, torch.bfloat16, H200, H200_SMS) == "cublas"


def test_the_key_names_the_software_that_was_timed():
    k = gemm_choice.key("grad_w2", 4096, 11008, 8000, torch.bfloat16, H200)
    assert f"torch {torch.__version__}" in k and "quack " in k
    assert "4096x8000 @ 8000x11008" in k
    with pytest.raises(ValueError, match="unknown GEMM 'fc3'"):
        gemm_choice.key("fc3", 1, 1, 1, torch.bfloat16, H200)


def test_record_merges_with_what_is_cached():
    first = gemm_choice.key("fc2", 1, 2, 3, torch.bfloat16, H200)
    second = gemm_choice.key("grad_w2", 1, 2, 3, torch.bfloat16, H200)
    gemm_choice.record({first: {"backend": "cublas"}})
    path = gemm_choice.record({second: {"backend": "cublas"}})
    assert set(json.loads(path.read_text())["choices"]) == {first, second}


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"schema": 99, "choices": {}}',
        '{"schema": 1, "choices": {"k": {"backend": "x"}}}',
    ],
    ids=["damaged", "other schema", "unknown backend"],
)
def test_an_unreadable_cache_warns_and_keeps_the_defaults(cache_dir, content):
    (cache_dir / "gemm_choices.json").write_text(content)
    with pytest.warns(UserWarning, match="unreadable GEMM cache"):
        assert gemm_choice.choice("fc2", 1, 2, 3, torch.bfloat16, H200, H200_SMS) == "cublas"
    path = gemm_choice.record({"k": {"backend": "cublas"}})  # a damaged cache is replaced
    assert json.loads(path.read_text()) == {"schema": 1, "choices": {"k": {"backend": "cublas"}}}


def test_gemm_sizes_are_the_products_the_impls_run():
    m, d, f, o = 8000, 4096, 11008, 4096
    assert gemm_choice.gemm_sizes("fc2", m, d, f, o) == (m, o, f)  # h [M, F] @ W2ᵀ [F, O]
    assert gemm_choice.gemm_sizes("grad_w2", m, d, f, o) == (o, f, m)  # grad_yᵀ [O, M] @ h
    assert gemm_choice.gemm_sizes("grad_x_packed", m, d, f, o) == (m, d, 2 * f)
    assert gemm_choice.gemm_sizes("grad_w1_packed", m, d, f, o) == (2 * f, d, m)
    assert gemm_choice.gemm_sizes("grad_x_concat", m, d, f, o) == (m, d, 2 * f)
    assert gemm_choice.gemm_sizes("grad_w1_concat", m, d, f, o) == (2 * f, d, m)


def test_planned_times_each_gemm_once():
    shapes = [(8000, 4096, 11008, 4096), (4096, 4096, 11008, 4096)]
    plan = pretune.planned(shapes, ["drop_h_quack", "save_factors_quack"])
    assert len(plan) == len(set(plan)) == 12  # 6 GEMMs x 2 token counts, fc2/grad_w2 shared
    assert pretune.planned(shapes[:1], ["drop_h_quack"]) == [
        ("fc2", 8000, 4096, 11008),
        ("grad_w1_concat", 22016, 4096, 8000),
        ("grad_w2", 4096, 11008, 8000),
        ("grad_x_concat", 8000, 4096, 22016),
    ]


@pytest.mark.parametrize(
    ("cublas", "dynamic", "default", "expected"),
    [  # each library's time over static quack's, per sample
        (0.95, 1.0, "quack", "cublas"),
        (0.995, 1.0, "quack", "quack"),  # within the margin: the default
        (0.995, 1.0, "cublas", "cublas"),
        (1.005, 1.0, "cublas", "cublas"),
        (1.05, 1.0, "cublas", "quack"),
        (0.97, 0.95, "quack", "quack_dynamic"),  # both past the margin: the faster
        (1.0, 0.98, "quack", "quack_dynamic"),
        (1.0, 1.02, "quack_dynamic", "quack"),
        (0.95, 0.97, "quack_dynamic", "cublas"),
    ],
)
def test_the_fastest_library_past_the_margin_is_chosen_and_a_tie_keeps_the_default(
    cublas, dynamic, default, expected
):
    quack = np.full(30, 2.0)
    times = {"quack": quack, "quack_dynamic": quack * dynamic, "cublas": quack * cublas}
    assert pretune.decide(times, default) == expected


def test_a_library_that_fails_is_left_out_unless_it_is_the_default() -> None:
    ran = []

    def works(name):
        return lambda: ran.append(name)

    def fails():
        raise RuntimeError("no kernel for this layout\nsecond line")

    ways = {"quack": works("quack"), "quack_dynamic": fails, "cublas": works("cublas")}
    assert pretune._warm(ways, keep="quack") == {
        "quack_dynamic": "RuntimeError: no kernel for this layout"
    }
    assert set(ways) == {"quack", "cublas"} and ran.count("quack") == 3
    with pytest.raises(RuntimeError, match="no kernel"):
        pretune._warm({"quack": fails}, keep="quack")


def test_ratios_are_paired_per_sample() -> None:
    """A slow sample slows every library in it: the paired ratio sees through it, a ratio of
    medians would not."""
    quack = np.array([1.0, 1.0, 3.0, 3.0, 3.0])
    times = {"quack": quack, "cublas": quack * 0.9}
    assert pretune.paired_ratio(times, "cublas", "quack") == pytest.approx(0.9)


def test_a_cached_dynamic_schedule_is_read_back(cache_dir) -> None:
    k = gemm_choice.key("grad_x_concat", 8000, 4096, 28672, torch.bfloat16, H200)
    gemm_choice.record({k: {"backend": "quack_dynamic"}})
    chosen = gemm_choice.choice("grad_x_concat", 8000, 4096, 28672, torch.bfloat16, H200, H200_SMS)
    assert chosen == "quack_dynamic"


def test_pretune_refuses_in_one_line_where_quack_cannot_run():
    runner = CliRunner()
    args = ["pretune", "--hidden-size", "64", "--ffn-hidden-size", "128", "--tokens", "256"]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert "the quack impls cannot run here" in result.output
    bad = runner.invoke(app, [*args, "--impls", "drop_h"])
    assert bad.exit_code != 0 and "choose from ['drop_h_quack', 'save_factors_quack']" in bad.output


@pytest.mark.gpu
@pytest.mark.parametrize("library", gemm_choice.LIBRARIES)
def test_cached_choices_compute_the_same_mlp(cache_dir, library):
    """Every plain GEMM cached on ``library``: both quack impls still match the float64 MLP,
    and pretune's own timing writes a choice for each GEMM it planned."""
    from helpers import TOLERANCE, reference_outputs, rel_err, run_outputs

    from swiglu_train.layers import ParMLP
    from swiglu_train.ops.quack_mlp import quack_available

    if not quack_available():
        pytest.skip("quack does not run here")
    m, d, f = 1000, 256, 512
    name = torch.cuda.get_device_name()
    entries = {
        gemm_choice.key(g, *gemm_choice.gemm_sizes(g, m, d, f, d), torch.bfloat16, name): {
            "backend": library
        }
        for g in gemm_choice.DEFAULTS
    }
    gemm_choice.record(entries)
    for impl in ("drop_h_quack", "save_factors_quack"):
        mlp = ParMLP(d, f, impl=impl, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        grad_y = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        expected, actual = reference_outputs(mlp, x, grad_y), run_outputs(mlp, x, grad_y)
        for key in expected:
            assert rel_err(actual[key], expected[key]) < TOLERANCE[torch.bfloat16], (impl, key)
    rows = pretune.pretune([(m, d, f, d)], ["save_factors_quack"], torch.bfloat16, samples=30)
    assert {r.gemm for r in rows} == set(gemm_choice.IMPL_GEMMS["save_factors_quack"])
    assert all(r.backend in gemm_choice.LIBRARIES and r.quack_dynamic_ms > 0 for r in rows)
    assert all(r.failed == {} for r in rows)


def test_the_defaults_probe_counts_wins_past_the_margin_per_gemm():
    """benchmarks/gemm_defaults.py's summary: a 1 % tie counts for neither library, and the
    majority decides (quack on an even split)."""
    spec = importlib.util.spec_from_file_location(
        "probe_gemm_defaults", ROOT / "benchmarks/gemm_defaults.py"
    )
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    def row(gemm: str, cublas: float, dynamic: float = 1.0) -> dict:
        return {"gemm": gemm, "cublas_over_quack": cublas, "quack_dynamic_over_quack": dynamic}

    rows = [row("fc2", r) for r in (0.95, 0.97, 1.005, 1.03)]
    rows += [row("grad_w2", r) for r in (0.95, 1.05)]
    rows += [row("grad_x_concat", 0.98, d) for d in (0.97, 0.98, 1.0)]
    summary = probe.summarise(rows, 0.01)
    assert summary["fc2"] == {
        "shapes": 4,
        "cublas": {"wins": 2, "losses": 1, "median_over_quack": pytest.approx(0.9875),
                   "min": 0.95, "max": 1.03},
        "quack_dynamic": {"wins": 0, "losses": 0, "median_over_quack": 1.0, "min": 1.0,
                          "max": 1.0},
        "majority": "cublas",
    }  # fmt: skip
    # cuBLAS 3 net wins over static quack, the dynamic schedule 2: cuBLAS
    assert summary["grad_x_concat"]["majority"] == "cublas"
    assert summary["grad_w2"]["majority"] == "quack"


def test_pretune_takes_a_model_s_shapes_from_its_pretrain_config():
    from swiglu_train.cli.tune import pretune_shapes
    from swiglu_train.integrations.lightning.config import load_config

    cfg = load_config("1b")
    d, f = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    tokens = cfg.data.micro_batch_size * cfg.data.seq_length
    assert pretune_shapes("1b", None, None, None, None) == [(tokens, d, f, d)]
    # options beside the config override it
    assert pretune_shapes("1b", None, None, "512,1024", None) == [(512, d, f, d), (1024, d, f, d)]
    assert pretune_shapes(None, 64, 128, "256", 32) == [(256, 64, 128, 32)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hidden-size", "64", "--tokens", "256"], "give --config (a pretrain config), or"),
        (["--config", "nope"], "config 'nope' not found; named configs:"),
    ],
)
def test_pretune_names_what_is_missing_or_unknown(args, message):
    result = CliRunner().invoke(app, ["pretune", *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


def test_untimed_lists_the_gemms_no_pretune_chose_at_that_shape(cache_dir):
    shape = (8000, 4096, 11008, 4096)
    timed = gemm_choice.key("fc2", *gemm_choice.gemm_sizes("fc2", *shape), torch.bfloat16, H200)
    gemm_choice.record({timed: {"backend": "cublas"}})
    assert gemm_choice.untimed("save_factors_quack", shape, torch.bfloat16, H200) == [
        "grad_w2", "grad_x_packed", "grad_w1_packed"
    ]  # fmt: skip
    assert "fc2" in gemm_choice.untimed("save_factors_quack", shape, torch.float16, H200)
    assert gemm_choice.untimed("drop_h", shape, torch.bfloat16, H200) == []  # no choices


def test_pretrain_names_the_untimed_gemms_and_the_command_that_times_them(cache_dir):
    from swiglu_train.integrations.lightning.pretune_hint import hints

    layers = [("drop_h_quack", 4096, 11008, 4096)] * 3  # one line per distinct layer
    (line,) = hints(layers, 8192, torch.bfloat16, H200)
    assert line.startswith("drop_h_quack at [M, D, F] = [8192, 4096, 11008]: fc2, grad_w2, ")
    assert (
        "`swiglu-train pretune --hidden-size 4096 --ffn-hidden-size 11008 --tokens 8192 "
        "--impls drop_h_quack` times them once" in line
    )
    entries = {
        gemm_choice.key(g, *gemm_choice.gemm_sizes(g, 8192, 4096, 11008, 4096), torch.bfloat16,
                        H200): {"backend": "quack"}
        for g in gemm_choice.IMPL_GEMMS["drop_h_quack"]
    }  # fmt: skip
    gemm_choice.record(entries)
    assert hints(layers, 8192, torch.bfloat16, H200) == []  # all timed: nothing to say
