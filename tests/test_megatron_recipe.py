"""recipes/pretrain_megatron.py on CPU: TP=2 under torchrun, memory to W&B offline, and a
dist-ckpt resume whose next loss is the uninterrupted run's."""

from __future__ import annotations

import csv
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_support import free_port, make_optimizer, megatron_parallel, spawn

LAUNCHER = Path(__file__).with_name("megatron_recipe_cpu.py")
RECIPE = LAUNCHER.parents[1] / "recipes" / "pretrain_megatron.py"
TINY = [
    *("--device", "cpu", "--num-layers", "2", "--hidden-size", "64"),
    *("--ffn-hidden-size", "96", "--num-attention-heads", "4", "--seq-length", "32"),
    *("--vocab-size", "128", "--micro-batch-size", "2"),
]


def run_recipe(tmp_path: Path, *args: str, tp: int = 2) -> dict[int, float]:
    """Run the recipe on ``tp`` gloo ranks at that TP size; returns each step's printed loss."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc-per-node", str(tp), "--master-port", str(free_port())]
    # The kernels are tested elsewhere; the torch backend keeps this run quick.
    env = os.environ | {"WANDB_MODE": "offline", "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [
            *command,
            str(LAUNCHER),
            *TINY,
            "--tp",
            str(tp),
            "--output-dir",
            str(tmp_path / "runs"),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = re.findall(r"^step (\d+) loss ([\d.]+) (\d+) tokens/s$", result.stdout, re.M)
    return {int(step): float(loss) for step, loss, _ in steps}


def test_recipe_trains_logs_memory_and_resumes(tmp_path: Path) -> None:
    # The packed impl: its resume also checks that the packed fc1 round-trips through dist-ckpt
    # (the other impls' numerics and checkpoints are tested in test_megatron_*.py).
    impl = "save_factors"
    losses = run_recipe(
        tmp_path,
        *("--mlp-impl", impl, "--max-steps", "4", "--save", "ckpt", "--save-interval", "3"),
        *("--summary-json", "out/summary.json"),
    )
    assert sorted(losses) == [0, 1, 2, 3]
    assert all(0 < loss < 10 for loss in losses.values())

    (memory_csv,) = (tmp_path / "runs" / "wandb").glob("offline-run-*/memory.csv")
    rows = list(csv.DictReader(memory_csv.open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    # Two decoder layers, each saving activations for backward.
    assert all(float(r["memory/layer/1/saved_MiB"]) > 0 for r in rows)
    # Megatron's MLP adapter counts as an MLP of its impl, inside each transformer layer.
    assert all(float(r[f"memory/impl/{impl}/saved_MiB"]) > 0 for r in rows)
    assert all(float(r["memory/layer/0/mlp_saved_MiB"]) > 0 for r in rows)

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["mlp_impl"] == impl and summary["tp"] == 2
    assert summary["initial_loss"] == pytest.approx(losses[0], rel=1e-5)
    assert summary["final_loss"] == pytest.approx(losses[3], rel=1e-5)
    assert summary["tokens_per_s"] > 0 and summary["saved_MiB"] > 0
    # Per rank, each MLP saves x [M, D], factors [M, 2F/tp] and h [M, F/tp] in fp32 (M = 2 x 32
    # tokens, D = 64, F = 96, tp = 2), over 2 layers: the analytic count, to the byte.
    assert summary["mlp_saved_MiB"][impl] * 2**20 == 2 * 64 * (64 + 3 * 48) * 4
    assert summary["peak_MiB"] is None  # CPU: no allocator figures

    assert (tmp_path / "ckpt" / "iter_0000003").is_dir()
    resumed = run_recipe(
        tmp_path, "--mlp-impl", impl, "--max-steps", "4", "--load", "ckpt/iter_0000003"
    )
    assert list(resumed) == [3]
    assert resumed[3] == pytest.approx(losses[3], rel=1e-6)


@pytest.mark.parametrize(("impl", "fused"), [("stock", True), ("stock_eager", False)])
def test_stock_baselines_differ_only_in_the_activation_fusion(impl: str, fused: bool) -> None:
    """Both stock runs build Megatron's own MLP; 'stock_eager' turns its compiled bias-SwiGLU
    off, the knob that isolates the activation when stock is slower than ours on the GPU."""
    recipe = runpy.run_path(str(RECIPE))
    args = recipe["parse_args"](["--device", "cpu", "--mlp-impl", impl])
    config = recipe["transformer_config"](args)
    assert config.bias_activation_fusion is fused and config.gated_linear_unit
    ours = recipe["transformer_config"](recipe["parse_args"](["--device", "cpu"]))
    assert not ours.bias_activation_fusion


def test_tp2_against_tp1_losses_agree_and_drop_h_saves_h_per_rank(tmp_path: Path) -> None:
    """scripts/compare_tp.py on real CPU runs (fp32): TP=2 reproduces TP=1's losses, and per
    rank drop_h saves exactly n_layers·M·(F/2)·4 bytes of saved tensors at TP=2."""
    runs = {}
    for impl, tp in (("normal", 1), ("normal", 2), ("drop_h", 2)):
        path = tmp_path / f"tp{tp}_{impl}.json"
        run_recipe(
            tmp_path, "--mlp-impl", impl, "--max-steps", "3", "--summary-json", str(path), tp=tp
        )
        runs[impl, tp] = path
    out = tmp_path / "compare.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_tp.py"
    command = [sys.executable, str(script), *map(str, runs.values()), "--bytes-per-element", "4"]
    plot = tmp_path / "losses.png"
    command += ["--json", str(out), "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    agreement = result["loss_agreement"]["normal"]
    assert agreement["tp_sizes"] == [1, 2] and agreement["steps"] == 3
    assert agreement["same_init"] and agreement["step0_abs_loss_diff"] < 1e-4
    assert agreement["max_rel_loss_diff"] < 1e-5
    assert plot.read_bytes().startswith(b"\x89PNG")
    saving = result["drop_h_saving"]["2"]
    # 2 layers x M = 2 x 32 tokens x F/2 = 48 x 4 bytes (fp32 on CPU)
    assert saving["analytic_MiB"] * 2**20 == 2 * 64 * 48 * 4
    assert saving["saved_for_backward_MiB"] == pytest.approx(saving["analytic_MiB"], rel=1e-9)
    assert saving["measured_MiB"] is None  # the allocator figure is CUDA's


def _fresh_optimizer_worker(rank: int, world_size: int, port: int) -> None:
    with megatron_parallel(rank, world_size, port):
        recipe = runpy.run_path(str(RECIPE))
        torch.manual_seed(0)
        models = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]
        models[1].load_state_dict(models[0].state_dict())
        optimizers = [make_optimizer(m) for m in models]
        recipe["init_optimizer_state"](optimizers[0])
        state = optimizers[0].optimizer.state
        assert len(state) == 2
        for s in state.values():
            assert s["step"] == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
        x = torch.randn(5, 8)
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
        for ours, fresh in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(ours, fresh)
        assert all(s["step"] == 1 for s in state.values())


def test_fresh_optimizer_state_for_a_resume_is_a_fresh_adam() -> None:
    """A resume first gives the fresh optimizer zero moments and step 0 (DistributedOptimizer
    cannot describe a stepless Adam), and that state trains exactly like a fresh Adam."""
    spawn(_fresh_optimizer_worker, 1)
