"""`pretrain --activation-checkpointing auto` and `--checkpoint-layers` on CPU: the planner's
measured steps, its plan applied to the run and recorded in the summary and W&B config, and
the refusals before any work."""

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import watch_planner_builds
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.model import LlamaDecoder
from swiglu_train.integrations.lightning.planner import Steps, candidates, measurer
from swiglu_train.memory.budget import ESTIMATE
from swiglu_train.memory.plan import NoPlanFits, Profile, choose_plan
from swiglu_train.memory.runs import load_runs
from swiglu_train.ops.quack_mlp import quack_available

runner = CliRunner()
SMALL = (
    "model: {hidden_size: 64, ffn_hidden_size: 160, num_heads: 2, num_layers: 2}\n"
    "data: {seq_length: 32, micro_batch_size: 2, val_fraction: 0.0}\n"
    "train: {max_steps: 2, checkpoint_every: 2}\n"
)
IMPLS = ("normal", "drop_h")


pytestmark = pytest.mark.usefixtures("offline_wandb_torch_math")


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL)
    return path


def pretrain(small: Path, tmp_path: Path, *args: str):
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    command = ["pretrain", "--config", str(small), "--output-dir", str(out)]
    result = runner.invoke(app, [*command, "--summary-json", str(summary), *args])
    return result, (json.loads(summary.read_text()) if summary.is_file() else None)


def test_auto_checkpoints_what_the_budget_needs_and_records_the_plan(small, tmp_path, caplog):
    # The CPU peak is an estimate (model state + saved bytes), the same at every step: a budget
    # between the impls' peaks with every block checkpointed and with none forces the planner
    # to checkpoint blocks.
    measure = measurer(load_config(str(small)), Steps(warmup=0, measured=1))
    none = {impl: measure(impl, 0).peak_MiB for impl in IMPLS}
    every = {impl: measure(impl, 2).peak_MiB for impl in IMPLS}
    assert max(every.values()) < min(none.values())
    budget_MiB = (max(every.values()) + min(none.values())) / 2
    result, summary = pretrain(
        small, tmp_path, "--activation-checkpointing", "auto", "--plan-impls", ",".join(IMPLS),
        "--memory-budget-gb", str(budget_MiB / 1024),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = summary["plan"]
    assert plan["impl"] in IMPLS and plan["checkpoint_layers"] >= 1
    assert plan["memory"] == ESTIMATE and plan["device"] == "cpu"
    assert plan["peak_MiB"] <= plan["budget_MiB"] == pytest.approx(budget_MiB)
    measured = {(p["impl"], p["checkpoint_layers"]): p for p in plan["profiles"]}
    for impl in IMPLS:  # every impl was tried without checkpointing first, and did not fit
        assert measured[impl, 0]["peak_MiB"] == pytest.approx(none[impl], rel=1e-12)
    # The run is the plan: its impl and blocks, and the saved bytes the planner measured there
    assert summary["mlp_impl"] == plan["impl"]
    assert summary["checkpoint_layers"] == plan["checkpoint_layers"]
    chosen = measured[plan["impl"], plan["checkpoint_layers"]]
    assert summary["saved_MiB"] == pytest.approx(chosen["after_forward_MiB"], rel=1e-12)
    # printed (Lightning's rank-zero log) before training, each measured point and then why
    assert f"plan: {plan['impl']} with {plan['checkpoint_layers']} of 2 blocks" in caplog.text
    assert f"planner: normal, 0 of 2 blocks checkpointed: peak {none['normal']:,.0f} MiB" in (
        caplog.text
    )
    [run] = load_runs([next((tmp_path / "run" / "wandb").glob("offline-run-*"))])
    assert run.config["plan"]["impl"] == plan["impl"]
    assert run.config["model"]["checkpoint_layers"] == plan["checkpoint_layers"]


def test_the_plan_s_models_are_gone_when_the_run_builds_its_own(small, monkeypatch):
    """plan_run's measured models and optimizers are freed before it returns: on a GPU they
    would otherwise sit beside the run's own model for the whole run."""
    from swiglu_train.integrations.lightning import planner

    built = watch_planner_builds(monkeypatch)
    cfg = load_config(str(small))
    cfg.train.activation_checkpointing, cfg.train.memory_budget_gb = "auto", 1.0
    cfg.train.plan_impls = list(IMPLS)
    record = planner.plan_run(cfg, Steps(warmup=0, measured=1))
    assert record["impl"] in IMPLS and len(built) == len(IMPLS)  # one model per candidate
    assert [ref() for ref in built] == [None] * len(IMPLS)


def test_each_candidate_s_model_is_gone_before_the_next_is_built(small, monkeypatch):
    """One measurer over several candidates holds one model at a time. A Fabric keeps every
    LightningModule it set up, so a Fabric shared across candidates kept them all: on the H200
    a 1B bench ran out of memory after a few. The allocator's peaks are absolute, too, so a
    held model would have counted in the next candidate's peak."""
    built = watch_planner_builds(monkeypatch)
    measure = measurer(load_config(str(small)), Steps(warmup=0, measured=1))
    for name in (*IMPLS, IMPLS[0]):
        assert measure(name, 0).peak_MiB > 0
    assert len(built) == len(IMPLS) + 1


def test_auto_micro_batch_picks_a_divisor_of_the_global_batch_and_accumulates(small, tmp_path):
    # Global batch 4: micro-batches 4, 2, 1. A budget below drop_h's unchecked peak at 4 and
    # above it at 2 rules the unchecked micro-batch 4 out and the unchecked 2 in.
    cfg = load_config(str(small))
    cfg.train.global_batch_size = 4
    measure = measurer(cfg, Steps(warmup=0, measured=1))
    at4, at2 = (measure("drop_h", 0, m).peak_MiB for m in (4, 2))
    assert at2 < at4
    budget_MiB = (at2 + at4) / 2
    result, summary = pretrain(
        small, tmp_path, "--activation-checkpointing", "auto", "--plan-impls", "drop_h",
        "--memory-budget-gb", str(budget_MiB / 1024), "--micro-batch-size", "auto",
        "--global-batch-size", "4", "--max-steps", "1",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = summary["plan"]
    micro = plan["micro_batch_size"]
    assert micro in (4, 2) and plan["peak_MiB"] <= budget_MiB
    assert plan["global_batch_size"] == 4 and plan["accumulate_grad_batches"] == 4 // micro
    points = {(p["micro_batch_size"], p["checkpoint_layers"]): p for p in plan["profiles"]}
    assert points[4, 0]["peak_MiB"] > budget_MiB  # tried largest first, unchecked, no fit
    assert (1, 0) not in points  # the descent stopped where it fit unchecked (2)
    assert points[2, 0]["peak_MiB"] <= budget_MiB
    # the pick is the fastest that fits of what was measured (the pure rule, on the record)
    again = choose_plan([Profile(**p) for p in plan["profiles"]], budget_MiB, 2)
    assert (again.micro_batch_size, again.checkpoint_layers) == (micro, plan["checkpoint_layers"])
    # the run is the plan: its micro-batch and accumulation, in the summary and W&B config
    assert summary["micro_batch_size"] == micro
    assert summary["accumulate_grad_batches"] == 4 // micro
    assert summary["checkpoint_layers"] == plan["checkpoint_layers"] and summary["steps"] == 1
    [run] = load_runs([next((tmp_path / "run" / "wandb").glob("offline-run-*"))])
    assert run.config["data"]["micro_batch_size"] == micro
    assert run.config["train"]["accumulate_grad_batches"] == 4 // micro
    assert run.config["plan"]["micro_batch_size"] == micro


def test_auto_micro_batch_from_the_yaml_and_its_refusals(small, tmp_path):
    yaml = tmp_path / "auto.yaml"
    train = (
        "train: {max_steps: 1, activation_checkpointing: auto, memory_budget_gb: 1, "
        "auto_micro_batch_size: true, global_batch_size: 6, accumulate_grad_batches: 2}"
    )
    yaml.write_text(SMALL.replace("train: {max_steps: 2, checkpoint_every: 2}", train))
    cfg = load_config(str(yaml))
    assert cfg.train.auto_micro_batch_size and cfg.train.global_batch_size == 6
    result, summary = pretrain(yaml, tmp_path)
    assert isinstance(result.exception, ValueError) and summary is None
    assert "sets train.accumulate_grad_batches" in str(result.exception)
    assert "leave it 1, not 2" in str(result.exception)
    result, _ = pretrain(small, tmp_path, "--micro-batch-size", "two")
    assert result.exit_code != 0
    assert "must be a positive integer or auto, got 'two'" in result.output
    assert not (tmp_path / "run").exists()


def test_a_measured_step_accumulates_its_micro_batches_and_steps_the_optimizer_once(small):
    """Global batch 8 at micro-batches 8, 4 and 2 (1, 2, 4 per optimizer step): each step
    runs its first micro-batch and one more when it accumulates, adding into the gradients
    (not zeroed between them), then AdamW once; its tokens/s is the global batch's tokens
    over the first + (A - 1) x the accumulating micro-batch + the optimizer step."""
    cfg = load_config(str(small))
    cfg.train.global_batch_size, cfg.train.gradient_clip_val = 8, 0.0  # unclipped: grads sum
    events, grads, watched = [], [], []

    def forward(module, args, output):
        if isinstance(module, LlamaDecoder):
            events.append("forward")
            watched[:] = [module.embed.weight]
            grad = watched[0].grad
            grads.append(None if grad is None else grad.clone())

    def step(optimizer, args, kwargs):
        events.append("step")
        grads.append(watched[0].grad.clone())

    hooks = [register_module_forward_hook(forward), register_optimizer_step_pre_hook(step)]
    try:
        measure = measurer(cfg, Steps(warmup=1, measured=2))
        profiles = {}
        for a in (1, 2, 4):
            events.clear()
            grads.clear()
            profiles[a] = measure("drop_h", 0, 8 // a)
            per_step = ["forward", "step"] if a == 1 else ["forward", "forward", "step"]
            assert events == per_step * 3  # AdamW once per optimizer step (1 warm-up + 2)
            if a > 1:  # the second micro-batch (same rows) added its gradient to the first's
                for i in range(3):
                    first, total = grads[3 * i + 1], grads[3 * i + 2]
                    torch.testing.assert_close(total, 2 * first, rtol=1e-6, atol=0)
        with pytest.raises(ValueError, match="needs the global batch it accumulates to"):
            measurer(load_config(str(small)))("drop_h", 0, 2)
    finally:
        for hook in hooks:
            hook.remove()
    for a, p in profiles.items():
        assert (p.micro_batch_size, p.accumulate_grad_batches) == (8 // a, a)
        assert p.micro_batch_s > 0 and p.optimizer_s > 0
        assert (p.accumulating_s is None) == (a == 1)
        step_s = p.micro_batch_s + (a - 1) * (p.accumulating_s or 0.0) + p.optimizer_s
        assert p.tokens_per_s == pytest.approx(8 * 32 / step_s)  # the global batch's tokens


def test_a_budget_nothing_fits_is_refused_naming_the_smallest_peak(small, tmp_path):
    result, summary = pretrain(
        small, tmp_path, "--activation-checkpointing", "auto", "--mlp-impl", "drop_h",
        "--memory-budget-gb", "0.001",
    )  # fmt: skip
    assert result.exit_code != 0 and summary is None
    assert isinstance(result.exception, NoPlanFits)
    message = str(result.exception)
    assert message.startswith("nothing fits the memory budget of 1 MiB: the smallest peak "
                              "measured is ")  # fmt: skip
    assert "(drop_h with 2 of 2 blocks checkpointed); raise the budget to at least" in message
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_manual_checkpoint_layers_from_the_flag_and_the_yaml(small, tmp_path):
    result, summary = pretrain(small, tmp_path, "--checkpoint-layers", "2", "--max-steps", "1")
    assert result.exit_code == 0, result.output
    assert summary["checkpoint_layers"] == 2 and summary["plan"] is None
    yaml = tmp_path / "with.yaml"
    yaml.write_text(SMALL.replace("num_layers: 2}", "num_layers: 2, checkpoint_layers: 1}"))
    assert load_config(str(yaml)).model.checkpoint_layers == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checkpoint-layers", "3"], r"checkpoint_layers=3 \(--checkpoint-layers\) must be "
         r"an integer from 0 to num_layers=2 \(blocks\)"),
        pytest.param(
            ["--activation-checkpointing", "auto"], r"on the CPU needs --memory-budget-gb",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU gives a budget"),
        ),
        (["--activation-checkpointing", "sometimes"], r"must be one of \('manual', 'auto'\)"),
        (["--memory-budget-gb", "40"], r"need --activation-checkpointing auto"),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "-1"], r"must be positive"),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "1", "--devices", "2"],
         r"measures one device; train.devices is 2"),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "1", "--plan-impls",
          "fast"], r"unknown impl 'fast'; the planner tries concrete impls: normal, drop_h"),
        pytest.param(
            ["--activation-checkpointing", "auto", "--memory-budget-gb", "1", "--plan-impls",
             "drop_h_quack"], r"drop_h_quack needs quack-kernels and an sm_90\+ GPU",
            marks=pytest.mark.skipif(quack_available(), reason="quack runs here"),
        ),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "1", "--plan-impls",
          "normal+fp8"], r"saved_fp8=True is for impls 'drop_h' and 'drop_h_quack' only, "
         r"not 'normal'"),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "1", "--resume", "last"],
         r"a resume keeps its run's plan"),
        (["--activation-checkpointing", "auto", "--memory-budget-gb", "1", "--micro-batch-size",
          "auto"], r"needs a global batch to divide: set train.global_batch_size"),
        (["--micro-batch-size", "auto", "--global-batch-size", "4"],
         r"--micro-batch-size auto is the planner's: it needs --activation-checkpointing auto"),
        (["--global-batch-size", "4"], r"is for --micro-batch-size auto; with a fixed "
         r"micro-batch set train.accumulate_grad_batches"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_before_any_work(small, tmp_path, args, message):
    result, summary = pretrain(small, tmp_path, *args)
    assert result.exit_code != 0 and summary is None
    assert isinstance(result.exception, ValueError), result.output
    assert re.search(message, str(result.exception)), str(result.exception)
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_points_read_the_allocator_and_an_out_of_memory_step_is_a_misfit(small):
    """On CUDA a point's peak is the allocator's, absolute (model state included); a step
    that runs out of memory is a point that does not fit, and frees what it held."""
    cfg = load_config(str(small))
    cfg.train.precision = "bf16-mixed"
    measure = measurer(cfg, Steps(warmup=1, measured=2))
    p = measure("drop_h", 0)
    assert p.tokens_per_s > 0 and 0 < p.after_forward_MiB < p.peak_MiB
    state_MiB = sum(q.numel() for q in measure_params(cfg)) * 16 / 2**20  # fp32 + grad + Adam
    assert p.peak_MiB > state_MiB
    cfg.train.global_batch_size = 2 * cfg.data.micro_batch_size  # two micro-batches a step
    two = measure("drop_h", 0, cfg.data.micro_batch_size)  # CUDA events time the parts
    assert two.accumulate_grad_batches == 2 and two.peak_MiB > state_MiB
    assert two.micro_batch_s > 0 and two.accumulating_s > 0 and two.optimizer_s > 0
    cfg.data.micro_batch_size = 1 << 22  # 2^22 x 32 tokens: far beyond any GPU
    huge = measurer(cfg, Steps(warmup=0, measured=1))("drop_h", 2)
    assert huge.peak_MiB is None and huge.tokens_per_s is None
    assert torch.cuda.memory_allocated() < 2**30  # the failed step's tensors are gone


def measure_params(cfg):
    from swiglu_train.integrations.lightning.model import LlamaDecoder

    return list(LlamaDecoder(cfg.model).parameters())


def test_saved_fp8_candidates_are_the_fp8_impls_that_run_here(small, monkeypatch):
    """model.saved_fp8 plans drop_h+fp8, and drop_h_quack+fp8 where quack runs."""
    from swiglu_train.ops import quack_mlp

    cfg = load_config(str(small))
    cfg.model.saved_fp8 = True
    monkeypatch.setattr(quack_mlp, "quack_available", lambda: False)
    assert candidates(cfg) == ["drop_h+fp8"]
    monkeypatch.setattr(quack_mlp, "quack_available", lambda: True)
    assert candidates(cfg) == ["drop_h+fp8", "drop_h_quack+fp8"]
