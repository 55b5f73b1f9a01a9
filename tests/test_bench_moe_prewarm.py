"""``bench-moe --prewarm-workers``: one job per model, sized from its tensors; the pool's GPU
budget keeping large points apart; a worker's task in process; and a real pre-warmed run on
CPU, whose spawned workers warm each model before the timing pass measures it."""

import json
import os

from typer.testing import CliRunner

from swiglu_train.bench import prewarm as pool_module
from swiglu_train.bench.moe.harness import MoEConfig
from swiglu_train.bench.moe.prewarm import (
    CONTEXT_BYTES,
    NOT_PREWARMED,
    moe_jobs,
    point_bytes,
    warm_moe_point,
)
from swiglu_train.bench.moe.shapes import parse_shapes, select_models
from swiglu_train.bench.prewarm import Job, Warmed, prewarm
from swiglu_train.cli import app


def test_a_model_is_one_job_at_its_first_routing_and_the_largest_comes_first():
    shapes = select_models(["qwen3-30b-a3b", "deepseek-v2-lite", "qwen1.5-moe-a2.7b"])
    cfg = MoEConfig(shapes, routings=("skewed", "balanced"))
    jobs = moe_jobs(cfg)
    assert [j.label for j in jobs] == [
        "qwen3-30b-a3b skewed", "deepseek-v2-lite skewed", "qwen1.5-moe-a2.7b skewed"
    ]  # fmt: skip
    # DeepSeek-V2-Lite and Qwen1.5-MoE share quack's and Triton's kernels: one compile shape
    assert [j.shape for j in jobs] == [(2048, 768), (2048, 1408), (2048, 1408)]
    assert [j.size for j in jobs] == [s.e * s.d * s.f for s in shapes]
    assert jobs[0].config == (cfg, shapes[0], "skewed")


def test_a_point_s_bytes_cover_its_weights_their_grads_and_its_largest_activations():
    (v3,) = select_models(["deepseek-v3"])
    cfg = MoEConfig([v3])
    weights = 3 * v3.e * v3.d * v3.f * 2  # bf16 fc1 and fc2: 22.5 GB
    normal = 8192 * 8 * 2 * (2 * v3.d + 3 * v3.f)  # what normal saves, the most of any variant
    tokens = 3 * 8192 * v3.d * 2  # x, its grad, grad_y
    assert point_bytes(cfg, v3) == 2 * weights + tokens + 3 * normal + CONTEXT_BYTES
    assert 45e9 < point_bytes(cfg, v3) < 60e9  # so two never share an 80 GB H100
    fp32 = MoEConfig([v3], dtype="fp32")
    assert point_bytes(fp32, v3) - CONTEXT_BYTES == 2 * (point_bytes(cfg, v3) - CONTEXT_BYTES)


def _named(label: str) -> Warmed:
    return Warmed(label, 0.0, os.getpid(), [label])


def _schedule(monkeypatch, budget: int | None) -> list[tuple[str, str]]:
    """The pool's submissions and completions, in the order the dispatcher made them (one
    thread: deterministic, whatever the workers' timing)."""
    events: list[tuple[str, str]] = []
    submit = pool_module._submit

    def recording(pool, workers, task, config):
        events.append(("start", config))
        return submit(pool, workers, task, config)

    monkeypatch.setattr(pool_module, "_submit", recording)
    jobs = [
        Job("big", "big", "a", 3.0, gpu_bytes=6),
        Job("big2", "big2", "b", 2.0, gpu_bytes=6),
        Job("small", "small", "c", 1.0, gpu_bytes=2),
        Job("huge", "huge", "d", 0.5, gpu_bytes=20),  # over the budget alone: it runs alone
    ]
    record = prewarm(jobs, 3, _named, lambda w: events.append(("done", w.label)), budget)
    assert not record["worker_errors"] and record["points"] == 4
    return events


def test_the_gpu_budget_keeps_two_large_points_apart_and_lets_a_small_one_in(monkeypatch):
    events = _schedule(monkeypatch, budget=8)
    at = {event: i for i, event in enumerate(events)}
    assert events[:2] == [("start", "big"), ("start", "small")]  # 6 + 2 fits in 8, 12 not
    assert at[("done", "big")] < at[("start", "big2")]
    last_done = max(at[("done", name)] for name in ("big", "big2", "small"))
    assert at[("start", "huge")] > last_done  # 20 alone, once nothing else runs
    unbounded = _schedule(monkeypatch, budget=None)
    assert unbounded[:3] == [("start", "big"), ("start", "big2"), ("start", "small")]


def test_a_worker_task_warms_each_variant_and_says_why_one_did_not():
    variants = ("drop_h", "hf_llama4", "liger")
    cfg = MoEConfig(parse_shapes("32,16,4,2"), ("balanced",), 16, variants, warmup=1,
                    device="cpu")  # fmt: skip
    outcome = warm_moe_point((cfg, cfg.shapes[0], "balanced"))
    assert outcome.label == "32x16-e4k2 balanced" and outcome.pid == os.getpid()
    assert outcome.warmed == ["drop_h"] and not outcome.error
    assert outcome.not_warmed["hf_llama4"].startswith("not offered: hf_llama4 applies")
    # an autotuner that times its candidates is left to the timing pass, never run here
    assert outcome.not_warmed["liger"] == NOT_PREWARMED["liger"]


def test_a_prewarmed_run_warms_each_model_in_a_worker_then_times_it(tmp_path):
    out = tmp_path / "moe.json"
    args = ["bench-moe", "--shapes", "32,16,4,2;48,24,4,2", "--tokens", "16", "--routing",
            "balanced,skewed", "--samples", "1", "--warmup", "1", "--device", "cpu",
            "--variants", "drop_h,loop", "--prewarm-workers", "2", "--out", str(out)]  # fmt: skip
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    lines = [line for line in done.output.splitlines() if line.startswith("[pre-warm")]
    assert len(lines) == 2 and all(" balanced: " in line for line in lines)
    result = json.loads(out.read_text())
    record = result["meta"]["prewarm"]
    assert record["workers"] == 2 and record["points"] == 2 and record["worker_errors"] == []
    assert record["elapsed_s"] > 0
    assert len(result["points"]) == 4 and all(r["ok"] for r in result["rows"] if "ok" in r)
