"""``recipes/pretrain_megatron.py --activation-checkpointing auto`` on CPU: the planner measures
the recipe's own model under Megatron's block recompute, picks what fits the budget, sets the
run's impl and recompute, and records the plan; what it cannot plan is refused before any work.
"""

from __future__ import annotations

import json
import weakref

import pytest
from megatron_support import (
    megatron_parallel,
    shim_cuda_only_calls,
    shim_distributed_optimizer,
    spawn,
)
from test_megatron_recipe import TINY, run_recipe
from test_megatron_recipe_moe import MOE

from swiglu_train.integrations.megatron.pretrain.args import parse_args
from swiglu_train.integrations.megatron.pretrain.plan import Steps, candidates, measurer, plan_run
from swiglu_train.memory.budget import ESTIMATE
from swiglu_train.memory.plan import NoPlanFits
from swiglu_train.ops.activation import use_backend

AUTO = ["--activation-checkpointing", "auto", "--plan-impls", "normal,drop_h"]
ONE = Steps(warmup=0, measured=1)


def _watch_builds() -> list:
    """Weak references to the parameters of each model the planner builds."""
    from swiglu_train.integrations.megatron.pretrain import plan

    built, real_build = [], plan.build_training

    def build(args):
        spec, model, optimizer = real_build(args)
        built.append([weakref.ref(p) for p in model.parameters()])
        return spec, model, optimizer

    plan.build_training = build  # a spawned worker: its module state dies with it
    return built


def _planner_worker(rank: int, world_size: int, rendezvous: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous), use_backend("torch"):
        args = parse_args([*TINY, *AUTO, "--memory-budget-gb", "1", "--max-steps", "2"])
        shim_cuda_only_calls(args.seed)
        built = _watch_builds()
        measure = measurer(args, ONE)
        normal = {n: measure("normal", n) for n in (0, 1, 2)}
        # every point's model is gone once it is measured (on CUDA a leak would inflate
        # every later peak; memory.budget.check_freed stops the plan there)
        assert len(built) == 3 and [r() for refs in built for r in refs if r() is not None] == []
        drop_h = measure("drop_h", 0)
        peaks = [normal[n].peak_MiB for n in (0, 1, 2)]
        assert peaks[0] > peaks[1] > peaks[2] > 0, peaks  # each recomputed layer saves
        assert drop_h.peak_MiB < peaks[0]  # drop_h keeps no h
        assert all(p.tokens_per_s > 0 for p in (*normal.values(), drop_h))

        # Under normal's unchecked peak and drop_h's, above normal's with 1 layer recomputed:
        # normal must recompute 1 layer; drop_h fits unchecked if its peak is under the budget
        budget = (peaks[1] + min(peaks[0], drop_h.peak_MiB)) / 2
        args.memory_budget_gb = budget / 1024
        record = plan_run(args, ONE)
        chosen = next(p for p in record["profiles"] if p["impl"] == record["impl"]
                      and p["checkpoint_layers"] == record["checkpoint_layers"])  # fmt: skip
        assert chosen["peak_MiB"] <= budget and record["memory"] == ESTIMATE
        # normal's search: unchecked over the budget, both layers under, then 1 (under);
        # its best plan is the faster of 1 and 2 (on a CPU this small, noise can pick 2)
        fits = {(p["impl"], p["checkpoint_layers"]): p["peak_MiB"] <= budget
                for p in record["profiles"]}  # fmt: skip
        assert [fits[("normal", n)] for n in (0, 1, 2)] == [False, True, True], fits
        best = {p["impl"]: p["checkpoint_layers"] for p in record["best_per_impl"]}
        assert best["normal"] in (1, 2)
        if drop_h.peak_MiB <= budget:  # one probe, unchecked (the peaks are exact counts)
            assert best["drop_h"] == 0 and ("drop_h", 1) not in fits
        else:
            assert best["drop_h"] in (1, 2) and not fits[("drop_h", 0)]
        assert args.mlp_impl == record["impl"] and not args.saved_fp8
        n = record["checkpoint_layers"]
        recompute = ("full", "block", n) if n else (None, None, None)
        assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == (
            recompute
        )
        assert record["recompute"]["num_layers"] == (n or None)

        args.memory_budget_gb = 1e-6
        with pytest.raises(NoPlanFits, match="nothing fits the memory budget"):
            plan_run(args, ONE)


@pytest.mark.slow
def test_the_plan_measures_the_recipe_s_model_and_sets_its_impl_and_recompute() -> None:
    spawn(_planner_worker, 1)


def _moe_planner_worker(rank: int, world_size: int, rendezvous: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous), use_backend("torch"):
        argv = [*TINY, *MOE, *AUTO[:2], "--memory-budget-gb", "1", "--max-steps", "2"]
        args = parse_args(argv)
        shim_cuda_only_calls(args.seed)
        assert candidates(args) == ["normal", "drop_h"]  # the routed experts' (no quack here)
        assert candidates(parse_args([*argv, "--saved-fp8"])) == ["drop_h+fp8"]
        measure = measurer(args, ONE)
        normal = {n: measure("normal", n) for n in (0, 1)}
        drop_h = measure("drop_h", 0)
        # drop_h's experts keep no h, no gathered input and no expert outputs
        assert drop_h.after_forward_MiB < normal[0].after_forward_MiB
        assert drop_h.peak_MiB < normal[0].peak_MiB and normal[1].peak_MiB < normal[0].peak_MiB
        budget = (normal[0].peak_MiB + max(drop_h.peak_MiB, normal[1].peak_MiB)) / 2
        args.memory_budget_gb = budget / 1024
        record = plan_run(args, ONE)
        fits = {(p["impl"], p["checkpoint_layers"]): p["peak_MiB"] <= budget
                for p in record["profiles"]}  # fmt: skip
        assert fits[("normal", 0)] is False and fits[("drop_h", 0)] is True
        assert record["impl"] in ("normal", "drop_h") and args.mlp_impl == record["impl"]
        assert fits[(record["impl"], record["checkpoint_layers"])]


@pytest.mark.slow
def test_an_moe_model_is_planned_over_the_routed_experts_impls() -> None:
    """--num-experts with --activation-checkpointing auto: the candidates are the experts'
    impls, each measured as its MoE model under Megatron's block recompute; drop_h's experts
    keep less than normal's, and the plan takes what fits."""
    spawn(_moe_planner_worker, 1)


def _distributed_optimizer_worker(rank: int, world_size: int, rendezvous: str) -> None:
    """The model and optimizer as the recipe builds them on CUDA: DDP with Megatron's
    DistributedOptimizer (shimmed onto CPU tensors)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from swiglu_train.integrations.megatron.pretrain import build, plan

    def model_as_on_cuda(args, config):
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True
        )
        return DistributedDataParallel(config=config, ddp_config=ddp,
                                       module=real_model(args, config).module)  # fmt: skip

    def optimizer_as_on_cuda(args, config, model):
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=args.lr, bf16=False, clip_grad=1.0,
                            use_distributed_optimizer=True), [model])  # fmt: skip
        config.grad_scale_func = optimizer.scale_loss
        return optimizer

    def watched(args):
        config, model, optimizer = real_training(args)
        state.extend(weakref.ref(t) for t in plan._state_tensors(model, optimizer))
        return config, model, optimizer

    real_model, real_training, state = build.build_model, plan.build_training, []
    build.build_model, build.build_optimizer = model_as_on_cuda, optimizer_as_on_cuda
    plan.build_training = watched  # a spawned worker: its module state dies with it
    with megatron_parallel(rank, world_size, rendezvous), use_backend("torch"):
        shim_distributed_optimizer()
        args = parse_args([*TINY, *AUTO, "--memory-budget-gb", "1", "--max-steps", "2"])
        shim_cuda_only_calls(args.seed)
        assert measurer(args, ONE)("normal", 1).peak_MiB > 0
        alive = [t for ref in state if (t := ref()) is not None]
        assert state and sum(t.untyped_storage().nbytes() for t in alive) == 0
        # What rightly outlives the point: Megatron's attention keeps its [b·heads, s, s]
        # scores in the process-wide global memory buffer, which the next point and the run
        # reuse. The leak check leaves it out (on the H200 it was the 1 GiB "leak").
        scores = args.micro_batch_size * args.num_attention_heads * args.seq_length**2
        assert plan.global_buffer_bytes() == scores * 4  # fp32 on the CPU


def test_a_measured_model_s_memory_is_released_even_where_it_outlives_its_point() -> None:
    """With the DistributedOptimizer the measured model outlives its point (its grad hooks are
    held in C++); every storage of its state is resized to 0 before the next point."""
    spawn(_distributed_optimizer_worker, 1)


def _micro_batch_worker(rank: int, world_size: int, rendezvous: str) -> None:
    with megatron_parallel(rank, world_size, rendezvous), use_backend("torch"):
        auto = ["--micro-batch-size", "auto", "--global-batch-size", "4"]
        args = parse_args([*TINY[:-2], *AUTO[:2], "--plan-impls", "normal", *auto,
                           "--memory-budget-gb", "1", "--max-steps", "2"])  # fmt: skip
        assert TINY[-2] == "--micro-batch-size" and args.micro_batch_size == "auto"
        shim_cuda_only_calls(args.seed)
        measure = measurer(args, ONE)
        at4, at1 = measure("normal", 2, 4), measure("normal", 2, 1)
        assert (at4.micro_batch_size, at4.accumulate_grad_batches) == (4, 1)
        assert (at1.micro_batch_size, at1.accumulate_grad_batches) == (1, 4)
        assert at1.peak_MiB < at4.peak_MiB  # both blocks recomputed: the least each can hold
        # a budget micro-batch 4 fits at no recompute count: the plan accumulates smaller ones
        args.memory_budget_gb = (at1.peak_MiB + at4.peak_MiB) / 2 / 1024
        planned = plan_run(args, ONE)
        assert (
            args.micro_batch_size in (1, 2) and args.num_microbatches == 4 // args.micro_batch_size
        )
        assert (planned["micro_batch_size"], planned["num_microbatches"]) == (
            args.micro_batch_size, args.num_microbatches)  # fmt: skip
        assert planned["global_batch_size"] == 4
        sizes = {p["micro_batch_size"] for p in planned["profiles"]}
        assert 4 in sizes and sizes <= {1, 2, 4}
        assert f"at micro-batch {args.micro_batch_size}" in planned["why"]


@pytest.mark.slow
def test_auto_micro_batch_accumulates_the_largest_that_fits_to_the_global_batch() -> None:
    """--micro-batch-size auto --global-batch-size 4: the plan measures each divisor, largest
    first, and sets the micro-batch and the accumulation to the global batch."""
    spawn(_micro_batch_worker, 1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--micro-batch-size", "auto"], "is the planner's: add --activation-checkpointing auto"),
        ([*AUTO[:2], "--memory-budget-gb", "1", "--micro-batch-size", "auto"],
         "--micro-batch-size auto needs --global-batch-size"),
        ([*AUTO[:2], "--memory-budget-gb", "1", "--micro-batch-size", "auto",
          "--global-batch-size", "4", "--num-microbatches", "2"],
         "sets --num-microbatches to the global batch; drop it"),
        (["--global-batch-size", "8"], "--global-batch-size goes with --micro-batch-size auto"),
        (["--micro-batch-size", "0"], "a positive number of sequences or auto, not '0'"),
    ],
)  # fmt: skip
def test_what_auto_micro_batch_cannot_take_is_refused(capsys, argv, message) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_recipe_trains_with_its_plan_at_the_micro_batch_it_chose_and_records_it(
    tmp_path,
) -> None:
    """End to end with --activation-checkpointing auto and --micro-batch-size auto: at an ample
    budget the largest divisor of the global batch fits unchecked, the run trains at the plan's
    impl and micro-batch, and its summary records the plan."""
    auto_micro_batch = ("--micro-batch-size", "auto", "--global-batch-size", "4")
    losses = run_recipe(
        tmp_path,
        *AUTO,
        *("--memory-budget-gb", "1", "--max-steps", "2", *auto_micro_batch),
        *("--summary-json", "out/summary.json"),
        tp=1,
    )
    assert sorted(losses) == [0, 1]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    planned = summary["planned"]
    assert planned["impl"] in ("normal", "drop_h") and summary["mlp_impl"] == planned["impl"]
    assert planned["checkpoint_layers"] == 0  # 1 GiB is ample for the tiny model
    assert summary["recompute"]["granularity"] is None and planned["why"].startswith(
        f"{planned['impl']} at micro-batch 4 with 0 of 2 blocks checkpointed"
    )
    assert (planned["micro_batch_size"], summary["num_microbatches"]) == (4, 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mlp-impl", "normal"], "drop --mlp-impl (--plan-impls names the impls to try)"),
        (["--recompute-granularity", "selective"], "drop --recompute-granularity"),
        (["--load", "ckpt"], "chooses the impl and the recompute for a new run; drop --load"),
        (["--tp", "2"], "measures one process (--tp 1 --pp 1, one rank)"),
        ([], "on the CPU needs --memory-budget-gb"),
        (["--memory-budget-gb", "0"], "--memory-budget-gb must be positive, got 0.0"),
        (["--memory-budget-gb", "1", "--plan-impls", "normal+fp8"], "'normal+fp8' is not one"),
        (["--memory-budget-gb", "1", "--plan-impls", ","], "--plan-impls is empty"),
        (
            ["--memory-budget-gb", "1", *MOE, "--plan-impls", "save_factors"],
            "'save_factors' is not one this recipe runs (normal, drop_h, drop_h_quack, stock",
        ),
        (["--memory-budget-gb", "1", *MOE, "--ep", "2"], "plan with --ep 1 at the run's"),
    ],
)
def test_what_auto_cannot_plan_is_refused_before_any_work(capsys, extra, message) -> None:
    argv = ["--device", "cpu", "--activation-checkpointing", "auto", *extra]
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert message in err, err


def test_candidates_default_to_ours_that_run_here_and_fp8_alone_with_saved_fp8() -> None:
    from swiglu_train.integrations.megatron.pretrain.plan import candidates

    args = parse_args([*TINY, "--activation-checkpointing", "auto", "--memory-budget-gb", "1"])
    assert candidates(args) == ["normal", "drop_h", "save_factors"]  # no quack on this CPU
    args.saved_fp8 = True
    assert candidates(args) == ["drop_h+fp8"]


def test_with_quack_the_fp8_candidates_take_drop_h_quack_s_too(monkeypatch) -> None:
    from swiglu_train.integrations.megatron.pretrain.plan import candidates
    from swiglu_train.ops import quack_mlp

    monkeypatch.setattr(quack_mlp, "quack_available", lambda: True)
    args = parse_args([*TINY, "--activation-checkpointing", "auto", "--memory-budget-gb", "1"])
    args.saved_fp8 = True
    assert candidates(args) == ["drop_h+fp8", "drop_h_quack+fp8"]
    parse_args([*TINY, "--activation-checkpointing", "auto", "--memory-budget-gb", "1",
                "--plan-impls", "drop_h_quack+fp8,drop_h"])  # fmt: skip


def test_a_model_left_allocated_after_its_point_stops_the_plan(monkeypatch) -> None:
    """On CUDA the peaks are absolute: more than LEAK_MiB still allocated after a point's
    model was freed would inflate every later peak, so the planners stop, naming the point
    (both call memory.budget.check_freed; the Lightning one leaked so on the H200 once)."""
    from swiglu_train.memory import budget

    monkeypatch.setattr(budget.torch.cuda, "memory_allocated", lambda: 1000 * 2**20)
    budget.check_freed(1000 * 2**20 - budget.LEAK_MiB * 2**20, "normal model")  # within
    left = r"planner's drop_h model left 1,000 MiB allocated.*Largest CUDA tensors alive: none"
    with pytest.raises(RuntimeError, match=left):
        budget.check_freed(0, "drop_h model", settle_s=0.3)


def test_memory_a_process_wide_cache_keeps_is_no_leak(monkeypatch) -> None:
    """The planner leaves Megatron's global memory buffer (``kept``) out of the check: the
    first point fills it, and the later points and the run reuse it."""
    from swiglu_train.memory import budget

    monkeypatch.setattr(budget.torch.cuda, "memory_allocated", lambda: 1500 * 2**20)
    budget.check_freed(0, "normal model", kept=lambda: 1024 * 2**20)  # 476 MiB: within
    with pytest.raises(RuntimeError, match="normal model left 1,500 MiB allocated"):
        budget.check_freed(0, "normal model", settle_s=0.2)


def test_memory_that_comes_back_late_is_no_leak(monkeypatch) -> None:
    """NCCL's watchdog retires a finished collective's tensors up to 100 ms later: the check
    waits for memory to come back before it calls a leak."""
    from swiglu_train.memory import budget

    readings = iter([2000 * 2**20, 2000 * 2**20, 0])  # freed on the third look
    monkeypatch.setattr(budget.torch.cuda, "memory_allocated", lambda: next(readings))
    # a long settle time: the check returns at the third look, and a loaded CI machine's
    # gc.collect() between looks must not run out the default 2 s first
    budget.check_freed(0, "normal model", settle_s=600.0)
    assert next(readings, None) is None  # it looked until the memory was back, and no more


def test_a_leak_s_error_names_what_holds_the_tensor() -> None:
    """The leak error names the largest live tensor's holder: an attribute as
    ``Owner.attribute``, a dict entry as ``[key] of`` the dict's holder (Megatron's global
    memory buffer keeps its tensors so, which the H200 run needed named)."""
    import torch

    from swiglu_train.memory import budget

    class GlobalMemoryBuffer:
        def __init__(self) -> None:
            self.buffer = {}

    class Holder:
        pass

    memory_buffer, scores = GlobalMemoryBuffer(), torch.empty(8)
    memory_buffer.buffer[("mpu", torch.bfloat16)] = scores
    named = budget._holders(scores)
    assert named == "[('mpu', torch.bfloat16)] of (GlobalMemoryBuffer.buffer)", named
    holder, other = Holder(), torch.empty(8)
    holder.kept = other
    assert budget._holders(other) == "Holder.kept"
    assert budget._holders(torch.empty(8)) == "nothing Python sees (a C++ holder)"
