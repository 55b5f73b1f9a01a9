"""recipes/pretrain_megatron.py on CPU: TP=2 under torchrun, memory to W&B offline, and a
dist-ckpt resume whose next loss is the uninterrupted run's."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron_support import megatron_parallel, shim_distributed_optimizer, spawn

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # isort: skip
from megatron.core.models.gpt import GPTModel  # isort: skip
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # isort: skip

from swiglu_train.integrations.megatron import get_gpt_layer_spec
from swiglu_train.integrations.megatron.pretrain import checkpoint
from swiglu_train.integrations.megatron.pretrain.args import parse_args
from swiglu_train.integrations.megatron.pretrain.build import transformer_config

LAUNCHER = Path(__file__).with_name("megatron_recipe_cpu.py")
RECIPE = LAUNCHER.parents[1] / "recipes" / "pretrain_megatron.py"
TINY = [
    *("--device", "cpu", "--num-layers", "2", "--hidden-size", "64"),
    *("--ffn-hidden-size", "96", "--num-attention-heads", "4", "--seq-length", "32"),
    *("--vocab-size", "128", "--micro-batch-size", "2"),
]


def run_recipe(tmp_path: Path, *args: str, tp: int = 2, dp: int = 1) -> dict[int, float]:
    """Run the recipe on tp x dp gloo ranks at that TP size; returns each step's printed loss."""
    torchrun = Path(sys.executable).with_name("torchrun")
    # --standalone: torchrun's own store picks a free port, which no other test can take first
    command = [str(torchrun), "--standalone", "--nproc-per-node", str(tp * dp)]
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


@pytest.mark.slow
def test_recipe_trains_logs_memory_and_resumes(tmp_path: Path) -> None:
    # The packed impl: its resume also checks that the packed fc1 round-trips through dist-ckpt
    # (the other impls' numerics and checkpoints are tested in test_megatron_*.py).
    impl = "save_factors"
    losses = run_recipe(
        tmp_path,
        *("--mlp-impl", impl, "--max-steps", "4", "--save", "ckpt", "--save-interval", "3"),
        *("--summary-json", "out/summary.json"),
        *("--profile-step", "2", "--profile-json", "out/profile.json"),
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
    # 4 steps, fewer than the 5 warm-up steps: the median is over all, and says so
    assert len(summary["step_tokens_per_s"]) == 4 and summary["warmup_steps"] == 0
    assert summary["tokens_per_s"] == statistics.median(summary["step_tokens_per_s"])
    assert summary["recompute"] == {"granularity": None, "method": None, "num_layers": None}
    assert summary["manual_gc"] is False and len(summary["step_gc_ms"]) == 4
    # each step's host time by phase adds up to the step's own (its tokens/s)
    tokens = 2 * 32  # micro-batch x sequence, one micro-batch, one DP rank
    for phases, rate in zip(summary["step_phases_s"], summary["step_tokens_per_s"], strict=True):
        assert sum(phases.values()) == pytest.approx(tokens / rate, rel=1e-9)
    assert summary["gc_ms_per_step"] == pytest.approx(statistics.fmean(summary["step_gc_ms"]))
    # what held each schedule: its fetch and forward inside it, and the thread's own counters
    for host, phases in zip(summary["step_schedule_host"], summary["step_phases_s"], strict=True):
        assert min(host["collate_s"], host["copy_s"], host["forward_s"]) > 0
        assert host["collate_s"] + host["copy_s"] + host["forward_s"] < phases["schedule_s"]
        assert host["schedule_cpu_s"] > 0 and host["schedule_minor_faults"] >= 0
        assert host["schedule_involuntary_switches"] >= 0 <= host["schedule_voluntary_switches"]
    assert summary["compile_workers_released"] is None  # 4 steps: still inside the warm-up
    threads = summary["host_threads"]
    assert threads["torch_threads"] >= 1 and threads["cpu_affinity"] >= 1
    assert threads["os_threads"] >= 1
    # Per rank, each MLP saves x [M, D], factors [M, 2F/tp] and h [M, F/tp] in fp32 (M = 2 x 32
    # tokens, D = 64, F = 96, tp = 2), over 2 layers: the analytic count, to the byte.
    assert summary["mlp_saved_MiB"][impl] * 2**20 == 2 * 64 * (64 + 3 * 48) * 4
    assert summary["peak_MiB"] is None  # CPU: no allocator figures

    # --profile-step: rank 0's step 2 as a per-op table (self time on the CPU), largest first
    profile = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert (profile["step"], profile["mlp_impl"], profile["tp"]) == (2, impl, 2)
    assert profile["unit"] == "op (self time)" and profile["step_s"] > 0
    times = [e["us"] for e in profile["entries"]]
    assert times == sorted(times, reverse=True)
    assert sum(times) + profile["other_us"] == pytest.approx(profile["total_us"])
    mm = next(e for e in profile["entries"] if e["name"] == "aten::mm")
    assert mm["count"] >= 2 * 3  # per layer at least the MLP's forward GEMMs and their grads

    assert (tmp_path / "ckpt" / "iter_0000003").is_dir()
    resumed = run_recipe(
        tmp_path, "--mlp-impl", impl, "--max-steps", "4", "--load", "ckpt/iter_0000003"
    )
    assert list(resumed) == [3]
    assert resumed[3] == pytest.approx(losses[3], rel=1e-6)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cpu", r"--device cpu needs Megatron's CUDA-only calls .* tests/megatron_recipe_cpu\.py"),
        ("cuda", r"torch sees no CUDA device; the CPU smoke mode runs as torchrun"),
    ],
)
def test_recipe_launched_directly_says_how_to_run_on_this_machine(device, message) -> None:
    """Straight from the README's command line, a CPU machine gets a sentence, not Megatron's
    CUDA assertion from deep inside its RNG tracker."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the recipe would start training")
    env = {k: v for k, v in os.environ.items() if k != "SWIGLU_TRAIN_MEGATRON_CPU_SHIMS"}
    result = subprocess.run(
        [sys.executable, str(RECIPE), "--device", device], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert re.search(message, result.stderr), result.stderr[-2000:]


@pytest.mark.parametrize(("impl", "fused"), [("stock", True), ("stock_eager", False)])
def test_stock_baselines_differ_only_in_the_activation_fusion(impl: str, fused: bool) -> None:
    """Both stock runs build Megatron's own MLP; 'stock_eager' turns its compiled bias-SwiGLU
    off, the knob that isolates the activation when stock is slower than ours on the GPU."""
    args = parse_args(["--device", "cpu", "--mlp-impl", impl])
    config = transformer_config(args)
    assert config.bias_activation_fusion is fused and config.gated_linear_unit
    ours = transformer_config(parse_args(["--device", "cpu"]))
    assert not ours.bias_activation_fusion


def test_saved_fp8_flag_is_for_drop_h(capsys) -> None:
    assert parse_args(["--saved-fp8"]).saved_fp8  # drop_h, the default impl
    assert not parse_args([]).saved_fp8
    for impl, reason in (("normal", "not 'normal': it saves h"), ("stock", "Megatron's own MLP")):
        with pytest.raises(SystemExit):
            parse_args(["--saved-fp8", "--mlp-impl", impl])
        assert reason in capsys.readouterr().err


@pytest.mark.slow
def test_tp2_and_dp2_against_tp1_losses_agree_and_drop_h_saves_h_per_rank(tmp_path: Path) -> None:
    """benchmarks/compare_tp.py on real CPU runs (fp32) at one global batch of 2 sequences: TP=2
    (micro-batch 2), DP=2 (micro-batch 1 per rank) and TP=1 in 2 micro-batches of 1 give the
    same losses, the DP run's being the mean over its ranks and the micro-batched one's not
    divided by the micro-batch count; per rank drop_h saves exactly n_layers·M·(F/2)·4 bytes of
    saved tensors at TP=2."""
    runs = {}
    for impl, tp, dp in (("normal", 1, 1), ("normal", 2, 1), ("drop_h", 2, 1), ("normal", 1, 2)):
        path = tmp_path / f"tp{tp}_dp{dp}_{impl}.json"
        split = {  # TINY's micro-batch is 2
            (1, 1): ["--micro-batch-size", "1", "--num-microbatches", "2"],
            (1, 2): ["--micro-batch-size", "1"],
        }.get((tp, dp), [])
        run_recipe(
            tmp_path,
            *("--mlp-impl", impl, "--max-steps", "3", "--summary-json", str(path), *split),
            tp=tp,
            dp=dp,
        )
        runs[impl, tp, dp] = path
    out = tmp_path / "compare.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_tp.py"
    command = [sys.executable, str(script), *map(str, runs.values()), "--bytes-per-element", "4"]
    plot = tmp_path / "losses.png"
    command += ["--json", str(out), "--plot", str(plot)]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    agreement = result["loss_agreement"]["normal"]
    assert agreement["layouts"] == ["TP1", "TP1xDP2", "TP2"] and agreement["steps"] == 3
    assert agreement["global_batch"] == 2
    assert agreement["same_init"] and agreement["step0_abs_loss_diff"] < 1e-4
    assert agreement["max_rel_loss_diff"] < 1e-5
    assert agreement["median_abs_loss_diff"] <= agreement["max_abs_loss_diff"]
    assert all(rate > 0 for rate in agreement["tokens_per_s"].values())
    assert result["gpu"] == "cpu"  # from the runs' summaries, which name their device
    assert plot.read_bytes().startswith(b"\x89PNG")
    saving = result["h_saving"]["drop_h"]["TP2"]
    # 2 layers x M = 2 x 32 tokens x F/2 = 48 x 4 bytes (fp32 on CPU)
    assert saving["analytic_MiB"] * 2**20 == 2 * 64 * 48 * 4
    assert saving["saved_for_backward_MiB"] == pytest.approx(saving["analytic_MiB"], rel=1e-9)
    assert saving["measured_MiB"] is None  # the allocator figure is CUDA's

    compare = runpy.run_path(str(script))
    loaded = compare["load"]([str(p) for p in runs.values()])
    loaded["normal", "TP1xDP2"]["num_microbatches"] = 2  # a global batch of 4: another loss
    with pytest.raises(ValueError, match=r"normal: the runs' global batches differ .*TP1xDP2': 4"):
        compare["loss_agreement"](loaded)


def _check_resume(root: str, impl: str) -> None:
    """Save a trained-looking DDP model and DistributedOptimizer at iteration 3, load it
    into a fresh one, and step both: the same weights, moments and step."""
    args = parse_args([*TINY, "--mlp-impl", impl])
    config = transformer_config(args)

    def build(seed: int):
        torch.manual_seed(seed)
        spec = get_gpt_layer_spec(impl)
        model = GPTModel(config, spec, vocab_size=128, max_sequence_length=32,
                         position_embedding_type="rope")  # fmt: skip
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        optimizer_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False,
                                           use_distributed_optimizer=True)  # fmt: skip
        return ddp, get_megatron_optimizer(optimizer_config, [ddp])

    model, optimizer = build(0)
    trained = optimizer.chained_optimizers[0]
    trained.init_state_fn(trained.optimizer, trained.config)
    for state in trained.optimizer.state.values():  # as if trained: moments and a step
        state["exp_avg"].normal_()
        state["exp_avg_sq"].uniform_()
        state["step"] = torch.tensor(7.0)
    checkpoint.save(root, 3, model, optimizer)
    fresh_model, fresh = build(1)
    assert checkpoint.load(f"{root}/iter_0000003", fresh_model, fresh) == 3
    for ours, theirs in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    loaded = fresh.chained_optimizers[0]
    pairs = zip(loaded.optimizer.param_groups, trained.optimizer.param_groups, strict=True)
    for group, trained_group in pairs:
        for p, q in zip(group["params"], trained_group["params"], strict=True):
            assert torch.equal(p, q)  # the fp32 main params
            state, trained_state = loaded.optimizer.state[p], trained.optimizer.state[q]
            assert torch.equal(state["exp_avg"], trained_state["exp_avg"])
            assert torch.equal(state["exp_avg_sq"], trained_state["exp_avg_sq"])
            assert state["step"] == 7
    assert "load_parameter_state_from_fully_reshardable" not in vars(loaded)  # unpatched

    # The next Adam step is the saving run's: Megatron hands every param one shared 'step'
    # tensor, which torch's Adam would bump once per param (step 7 + n_params).
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(32).expand(2, 32)
    causal = torch.ones(2, 1, 32, 32, dtype=torch.bool).triu(1)
    for ddp, opt in ((model, optimizer), (fresh_model, fresh)):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens, positions, causal, labels=tokens).float().mean().backward()
        ddp.finish_grad_sync()
        opt.step()
    assert all(state["step"] == 8 for state in loaded.optimizer.state.values())
    for ours, theirs in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def _resume_worker(rank: int, world_size: int, rendezvous: str, root: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous):
        shim_distributed_optimizer()
        for impl in ("drop_h", "save_factors"):  # canonical and packed fc1: one process start
            _check_resume(f"{root}/{impl}", impl)


@pytest.mark.slow
def test_distributed_optimizer_resume_restores_weights_moments_and_step(tmp_path) -> None:
    """The recipe's --load into a fresh DistributedOptimizer running torch's Adam (no Apex or
    TE: the GPU box's case, where it first failed): weights, fp32 main params, Adam moments and
    step come back exactly, a packed fc1 (save_factors) included, and the next step matches."""
    spawn(_resume_worker, 1, str(tmp_path / "ckpt"))


def test_recompute_options_reach_megatrons_config_and_bad_combinations_are_refused(capsys):
    full = ["--recompute-granularity", "full", "--recompute-method", "block"]
    args = parse_args(["--device", "cpu", *full, "--recompute-num-layers", "3"])
    config = transformer_config(args)
    assert (config.recompute_granularity, config.recompute_method) == ("full", "block")
    assert config.recompute_num_layers == 3 and args.mlp_impl == "drop_h"
    plain = transformer_config(parse_args(["--device", "cpu"]))
    assert plain.recompute_granularity is None and plain.recompute_num_layers is None
    for argv, message in (
        (["--recompute-num-layers", "2"], "need --recompute-granularity full"),
        (full[:2], "full needs --recompute-method (block or uniform) and --recompute-num-layers"),
        ([*full, "--recompute-num-layers", "5"], "from 1 to the layers per pipeline stage, 4"),
        (["--recompute-granularity", "selective", "--recompute-method", "block"],
         "selective takes no --recompute-method"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_profile_step_needs_its_json_and_a_step_of_the_run(capsys) -> None:
    from swiglu_train.integrations.megatron.pretrain.args import parse_args

    for argv, message in (
        (["--profile-step", "2"], "--profile-step and --profile-json go together"),
        (["--profile-json", "p.json"], "--profile-step and --profile-json go together"),
        (
            ["--profile-step", "4", "--profile-json", "p.json", "--max-steps", "4"],
            "--profile-step 4 is not a step of --max-steps 4",
        ),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    for argv in (["--manual-gc-interval", "5"], ["--manual-gc", "--manual-gc-interval", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "needs --manual-gc and N >= 0" in capsys.readouterr().err
    args = parse_args(["--profile-step", "3", "--profile-json", "p.json", "--max-steps", "4"])
    assert (args.profile_step, args.profile_json) == (3, "p.json")


def test_a_planner_record_sets_the_impl_and_block_recompute(tmp_path, capsys):
    """--plan takes what `pretrain --activation-checkpointing auto --summary-json` wrote."""
    plan = {"impl": "drop_h+fp8", "checkpoint_layers": 2, "num_layers": 4, "why": "..."}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"mlp_impl": "drop_h", "plan": plan}))
    args = parse_args(["--plan", str(path)])
    assert (args.mlp_impl, args.saved_fp8) == ("drop_h", True)
    assert (args.recompute_granularity, args.recompute_method) == ("full", "block")
    assert args.recompute_num_layers == 2
    path.write_text(json.dumps(plan | {"impl": "normal", "checkpoint_layers": 0}))
    args = parse_args(["--plan", str(path)])
    assert args.mlp_impl == "normal" and args.recompute_granularity is None
    for argv, message in (
        (["--num-layers", "8"], "was made for 4 layers, not --num-layers 8"),
        (["--mlp-impl", "normal"], "--plan sets the impl and the recompute; drop --mlp-impl"),
    ):
        with pytest.raises(SystemExit):
            parse_args(["--plan", str(path), *argv])
        assert message in capsys.readouterr().err
    path.write_text("{}")
    with pytest.raises(SystemExit):
        parse_args(["--plan", str(path)])
    assert "no planner record (impl, checkpoint_layers, num_layers)" in capsys.readouterr().err


def _planned_micro_batch_record(seq_length: int) -> dict:
    """The record the Lightning planner writes with --micro-batch-size auto, from its own
    code: a 4-block model, global batch 8, where micro-batch 2 (accumulating 4) fits 800 MiB
    and micro-batch 4 does not."""
    import torch

    from swiglu_train.integrations.lightning import planner
    from swiglu_train.integrations.lightning.config import load_config
    from swiglu_train.memory.plan import Profile, choose_plan

    cfg = load_config(None)
    cfg.model.num_layers, cfg.data.seq_length = 4, seq_length
    cfg.train.auto_micro_batch_size, cfg.train.global_batch_size = True, 8
    profiles = [
        Profile("drop_h", 1, 700.0, 1000.0, micro_batch_size=2, accumulate_grad_batches=4),
        Profile("drop_h", 0, 900.0, 1100.0, micro_batch_size=4, accumulate_grad_batches=2),
    ]
    plan = choose_plan(profiles, 800.0, 4)
    planner.apply_plan(cfg, plan)
    return planner.record(plan, profiles, cfg, torch.device("cpu"), planner.Steps())


def test_a_plan_that_chose_the_micro_batch_sets_it_and_the_accumulation(tmp_path, capsys):
    """With --micro-batch-size auto the planner chose the micro-batch for its global batch:
    --plan sets it and the accumulation per rank, and refuses either given by hand or a plan
    made at another sequence length."""
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"plan": _planned_micro_batch_record(seq_length=1024)}))
    args = parse_args(["--plan", str(path), "--seq-length", "1024"])
    assert (args.micro_batch_size, args.num_microbatches) == (2, 4)
    assert (args.mlp_impl, args.recompute_num_layers) == ("drop_h", 1)
    for argv, message in (
        (["--micro-batch-size", "4"], "sets the micro-batch (2) and the accumulation to its "
                                      "global batch of 8; drop --micro-batch-size"),
        (["--num-microbatches", "2"], "; drop --num-microbatches"),
        ([], "chose its micro-batch at --seq-length 1024, not 2048"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--plan", str(path), "--seq-length", "2048", *argv])
        assert message in capsys.readouterr().err
    args = parse_args(["--seq-length", "1024"])  # no plan: the defaults
    assert (args.micro_batch_size, args.num_microbatches) == (4, 1)


def _recompute_worker(rank: int, world_size: int, rendezvous: str) -> None:
    """Megatron's full recompute (its reentrant CheckpointFunction) of the first layer around
    our in-place impls: the same loss and grads, and that layer's saved bytes gone."""
    from swiglu_train.memory import MemoryProfiler

    with megatron_parallel(rank, world_size, rendezvous):
        tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
        positions = torch.arange(32).expand(2, 32)
        causal = torch.ones(2, 1, 32, 32, dtype=torch.bool).triu(1)
        for impl in ("drop_h", "save_factors"):
            results = []
            for recompute in ([], ["--recompute-granularity", "full", "--recompute-method",
                                   "block", "--recompute-num-layers", "1"]):  # fmt: skip
                args = parse_args([*TINY, "--mlp-impl", impl, *recompute])
                torch.manual_seed(0)
                model = GPTModel(transformer_config(args), get_gpt_layer_spec(impl),
                                 vocab_size=128, max_sequence_length=32,
                                 position_embedding_type="rope")  # fmt: skip
                profiler = MemoryProfiler(model)
                for step in range(2):  # twice: the in-place backwards' guards must not fire
                    model.zero_grad(set_to_none=True)
                    with profiler.step(step):
                        loss = model(tokens, positions, causal, labels=tokens).float().mean()
                        profiler.forward_done()
                        loss.backward()
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                results.append((loss.detach(), grads, profiler.records[-1]))
            (loss0, grads0, plain), (loss1, grads1, recomputed) = results
            assert torch.equal(loss0, loss1), impl
            for name, grad in grads0.items():
                torch.testing.assert_close(grads1[name], grad, rtol=1e-6, atol=1e-7)
            first, second = (layer.saved_bytes for layer in plain.layers)
            assert [la.saved_bytes for la in recomputed.layers][1] == second
            assert recomputed.saved_bytes < plain.saved_bytes - first // 2, impl


@pytest.mark.slow
def test_megatron_full_recompute_around_our_impls_gives_the_same_grads() -> None:
    spawn(_recompute_worker, 1)


def test_liger_is_megatron_s_mlp_with_liger_s_swiglu_patched_in(capsys, monkeypatch) -> None:
    """--mlp-impl liger: Megatron's own MLP on its fused SwiGLU path, which Liger's patch
    replaces (checked, and said); no --saved-fp8 (that is ours); without liger-kernel, an
    error naming the package. The patch is process-wide, so the test undoes it."""
    from megatron.core.fusions import fused_bias_swiglu

    from swiglu_train.integrations.megatron.pretrain.peers import patch_liger_swiglu

    args = parse_args(["--device", "cpu", "--mlp-impl", "liger"])
    assert transformer_config(args).bias_activation_fusion is True
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--mlp-impl", "liger", "--saved-fp8"])
    assert "--saved-fp8 is ours: Megatron's own MLP (liger) saves" in capsys.readouterr().err

    original = fused_bias_swiglu.SwiGLUFunction
    try:
        said = patch_liger_swiglu()
        assert fused_bias_swiglu.SwiGLUFunction.__wrapped__ is original
    finally:
        fused_bias_swiglu.SwiGLUFunction = original
    version = importlib.metadata.version("liger-kernel")
    assert said == (
        f"mlp: Megatron's MLP with Liger-Kernel {version}'s SwiGLU (fused gate-up kernel)"
    )

    monkeypatch.setitem(sys.modules, "liger_kernel.megatron", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"--mlp-impl liger needs liger-kernel>=0\.8\.5"):
        patch_liger_swiglu()
