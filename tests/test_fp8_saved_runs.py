"""FP8-saved runs beside bf16 ones, on real tiny pretrain runs (two seeds per arm, CPU):
benchmarks/plot_loss_ab.py's A/B report, and compare-memory's labels and exact byte counts."""

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.pretrain import run_pretrain
from swiglu_train.kernels.fp8_format import n_blocks
from swiglu_train.memory.plots import summary_rows
from swiglu_train.memory.runs import load_runs
from swiglu_train.ops import use_backend

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (1, 2)
ARMS = {"drop_h": False, "drop_h+fp8": True}
STEPS, LAST = 8, 3
LAYERS, HIDDEN, FFN, SEQ, BATCH = 2, 64, 160, 64, 4  # FFN 160: a whole and a partial block


def load_script():
    path = ROOT / "benchmarks/plot_loss_ab.py"
    spec = importlib.util.spec_from_file_location("plot_loss_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, int], dict]:
    """{(arm, seed): summary} of four runs, written to summary JSONs as pretrain's CLI does."""
    root = tmp_path_factory.mktemp("fp8_runs")
    out = {}
    with pytest.MonkeyPatch.context() as mp, use_backend("torch"):  # the interpreter crawls
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for seed in SEEDS:
            for arm, fp8 in ARMS.items():
                cfg = load_config(None)
                cfg.model.hidden_size, cfg.model.ffn_hidden_size = HIDDEN, FFN
                cfg.model.num_layers, cfg.model.num_heads = LAYERS, 2
                cfg.model.saved_fp8 = fp8
                cfg.data.seq_length, cfg.data.micro_batch_size = SEQ, BATCH
                cfg.data.val_fraction, cfg.data.seed = 0.0, seed
                cfg.data.data = [json.__file__]  # a small text no one edits while this runs
                cfg.train.max_steps = cfg.train.checkpoint_every = STEPS
                cfg.train.seed = seed
                cfg.output_dir = str(root / f"{arm}-{seed}")
                summary = run_pretrain(cfg)
                path = root / f"{arm}-{seed}.json"
                path.write_text(json.dumps(summary))
                out[arm, seed] = summary | {"path": str(path)}
    return out


def mean_of_last(summary: dict) -> float:
    losses = [summary["losses"][str(s)] for s in range(STEPS)]
    return statistics.fmean(losses[-LAST:])


def test_the_runs_differ_only_where_the_fp8_copy_acts(runs):
    """Step 0's loss is forward alone, which the option leaves as it is; the updates after it
    carry e4m3's rounding. The seeds give different inits."""
    for seed in SEEDS:
        bf16, fp8 = runs["drop_h", seed], runs["drop_h+fp8", seed]
        assert (bf16["saved_fp8"], fp8["saved_fp8"], bf16["seed"]) == (False, True, seed)
        assert fp8["losses"]["0"] == bf16["losses"]["0"]
        assert fp8["losses"][str(STEPS - 1)] != bf16["losses"][str(STEPS - 1)]
    assert runs["drop_h", 1]["losses"]["0"] != runs["drop_h", 2]["losses"]["0"]


def test_the_ab_report_of_real_runs(runs, tmp_path, capsys):
    out = {ext: tmp_path / f"ab.{ext}" for ext in ("json", "md", "png")}
    paths = [runs[key]["path"] for key in sorted(runs)]
    files = ["--json", out["json"], "--md", out["md"], "--plot", out["png"]]
    argv = [*paths, "--last", str(LAST), "--smooth", "2", "--commit", "abc", *files]
    result = load_script().main(list(map(str, argv)))
    finals = {key: mean_of_last(summary) for key, summary in runs.items()}
    low = min(finals["drop_h", s] for s in SEEDS)
    high = max(finals["drop_h", s] for s in SEEDS)
    base = result["baseline"]
    assert base["final_loss"] == {str(s): pytest.approx(finals["drop_h", s]) for s in SEEDS}
    assert base["spread"] == pytest.approx({"low": low, "high": high, "width": high - low})
    fp8 = result["arms"]["drop_h+fp8"]["runs"]
    for seed in SEEDS:
        value, row = finals["drop_h+fp8", seed], fp8[str(seed)]
        assert row["final_loss"] == pytest.approx(value)
        assert row["within_spread"] == (low <= value <= high)
        expected_gap = max(value - high, 0.0) + min(value - low, 0.0)
        assert row["outside_by"] == pytest.approx(expected_gap, abs=1e-12)
        assert row["minus_baseline_same_seed"] == pytest.approx(value - finals["drop_h", seed])
    assert result["arms"]["drop_h+fp8"]["all_within_spread"] == all(
        fp8[str(s)]["within_spread"] for s in SEEDS
    )
    assert json.loads(out["json"].read_text()) == result
    assert result["steps"] == STEPS and result["commit"] == "abc"
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["md"].read_text() == capsys.readouterr().out.removesuffix("\n")


def broken_copy(runs: dict, tmp_path: Path, key: tuple, **change) -> str:
    """A copy of one run's summary with keys changed (None: removed)."""
    summary = {k: v for k, v in runs[key].items() if change.get(k, 0) is not None}
    summary |= {k: v for k, v in change.items() if v is not None}
    path = tmp_path / f"{key[0]}-{key[1]}-broken.json"
    path.write_text(json.dumps(summary))
    return str(path)


def test_runs_the_ab_cannot_compare_are_refused_by_name(runs, tmp_path, capsys):
    main = load_script().main
    path = {key: summary["path"] for key, summary in runs.items()}
    cases = [
        ([broken_copy(runs, tmp_path, ("drop_h", 1), saved_fp8=None), path["drop_h", 2]],
         "drop_h-1-broken.json: no saved_fp8; pass `swiglu-train pretrain --summary-json`"),
        ([path["drop_h", 1], path["drop_h+fp8", 1]],
         "the baseline 'drop_h' needs runs at two seeds at least for a spread; got 1"),
        ([path["drop_h", 1], path["drop_h", 2]], "no run other than the baseline 'drop_h'"),
        ([path["drop_h", 1], path["drop_h", 2], path["drop_h", 1]],
         "a second drop_h run at seed 1"),
        ([path["drop_h", 1], path["drop_h", 2],
          broken_copy(runs, tmp_path, ("drop_h+fp8", 1), seed=3)],
         "drop_h+fp8 ran at seeds [3], where the baseline 'drop_h' did not"),
        ([path["drop_h", 1], path["drop_h", 2],
          broken_copy(runs, tmp_path, ("drop_h+fp8", 2), steps=STEPS + 1)],
         "the runs trained different numbers of steps or logged different losses"),
    ]  # fmt: skip
    for paths, message in cases:
        with pytest.raises(SystemExit):
            main([*paths, "--last", str(LAST)])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([path["drop_h", 1], path["drop_h", 2], path["drop_h+fp8", 1], "--last", "9"])
    assert f"{STEPS} losses logged, fewer than --last 9" in capsys.readouterr().err


def test_a_diverged_run_is_reported_outside_the_spread(runs, tmp_path):
    losses = dict(runs["drop_h+fp8", 1]["losses"]) | {str(STEPS - 1): math.nan}
    diverged = broken_copy(runs, tmp_path, ("drop_h+fp8", 1), losses=losses)
    paths = [runs["drop_h", 1]["path"], runs["drop_h", 2]["path"], diverged]
    result = load_script().main([*paths, "--last", str(LAST)])
    row = result["arms"]["drop_h+fp8"]["runs"]["1"]
    assert row == {"final_loss": None, "within_spread": False, "finite": False}
    assert result["arms"]["drop_h+fp8"]["all_within_spread"] is False


def wandb_dir(summary: dict) -> Path:
    (run_dir,) = Path(summary["output_dir"]).glob("wandb/offline-run-*")
    return run_dir


def test_compare_memory_shows_fp8_runs_beside_bf16_at_their_true_bytes(runs, tmp_path):
    """Labelled by the impl as the profiler names it (drop_h+fp8), and the per-impl saved
    bytes exact: per MLP x in fp32 (a CPU run), then the preactivation in fp32, or as e4m3
    values (1 byte) and bf16 scales per 128 columns of each half."""
    dirs = [wandb_dir(runs["drop_h", 1]), wandb_dir(runs["drop_h+fp8", 1])]
    loaded = load_runs(dirs)
    assert [run.label for run in loaded] == ["drop_h", "drop_h+fp8"]
    _, rows = summary_rows(loaded)
    assert [row[:2] for row in rows] == [["drop_h", "drop_h"], ["drop_h+fp8", "drop_h+fp8"]]
    tokens = BATCH * SEQ
    x = tokens * HIDDEN * 4
    expected = {
        "drop_h": LAYERS * (x + tokens * 2 * FFN * 4),
        "drop_h+fp8": LAYERS * (x + tokens * 2 * FFN + tokens * 2 * n_blocks(FFN) * 2),
    }
    for run in loaded:
        key = f"memory/impl/{run.label}/saved_MiB"
        assert set(run.series[key]) == {expected[run.label] / 2**20}, key  # every step
    result = CliRunner().invoke(app, ["compare-memory", *map(str, dirs), "--out",
                                      str(tmp_path / "memory.png")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "memory.png").stat().st_size > 0 and (tmp_path / "memory.html").exists()
