"""recipes/pretrain_megatron.py with ``--num-experts``: a tiny MoE GPT trains on two gloo ranks
with expert parallelism, our experts counted apart from the dense MLPs in the memory figures;
the MoE flags reach Megatron's config and the combinations it cannot run are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_megatron_recipe import run_recipe

from swiglu_train.integrations.megatron.pretrain.args import parse_args
from swiglu_train.integrations.megatron.pretrain.build import transformer_config

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32"]


@pytest.mark.slow
def test_moe_recipe_trains_with_expert_parallelism(tmp_path: Path) -> None:
    losses = run_recipe(
        tmp_path,
        *MOE,
        *("--ep", "2", "--max-steps", "3", "--summary-json", "out/summary.json"),
        *("--mlp-impl", "auto"),  # the experts' auto: drop_h on the CPU
        tp=1,
        dp=2,
    )
    assert sorted(losses) == [0, 1, 2] and all(0 < loss < 10 for loss in losses.values())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["mlp_impl"] == "auto" and summary["dp"] == 2
    # the memory profiler counts each rank's local experts (their saved bytes vary with the
    # routing) and labels them apart from dense MLPs
    assert set(summary["mlp_saved_MiB"]) == {"experts/drop_h"}
    assert summary["mlp_saved_MiB"]["experts/drop_h"] > 0


def test_moe_flags_reach_megatrons_config(capsys) -> None:
    args = parse_args(["--device", "cpu", *MOE, "--moe-router-topk", "1", "--ep", "2"])
    config = transformer_config(args)
    assert (config.num_moe_experts, config.moe_ffn_hidden_size) == (4, 32)
    assert config.moe_router_topk == 1 and config.moe_router_pre_softmax  # Megatron's rule at 1
    assert config.expert_model_parallel_size == 2 and config.moe_aux_loss_coeff == 1e-2
    assert config.moe_token_dispatcher_type == "alltoall"
    assert parse_args(["--device", "cpu", *MOE, "--mlp-impl", "auto"]).mlp_impl == "auto"
    dense = transformer_config(parse_args(["--device", "cpu"]))
    assert dense.num_moe_experts is None
    for argv, message in (
        (["--ep", "2"], "--ep configure MoE layers: add --num-experts"),
        ([*MOE, "--mlp-impl", "save_factors"], "does not run routed experts"),
        (["--mlp-impl", "auto"], "--mlp-impl auto is the MoE experts' (add --num-experts)"),
        ([*MOE, "--ep", "3"], "--ep 3 must divide --num-experts 4"),
        ([*MOE, "--tp", "2"], "needs --sequence-parallel"),
        ([*MOE, "--moe-router-topk", "5"], "need 1 <= topk <= experts"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv
