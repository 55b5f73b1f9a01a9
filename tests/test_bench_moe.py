"""``bench-moe`` on CPU: the shape table, the routings, the floor's GEMMs, the report and its
merge, and a whole tiny run (timings there are smoke only; the correctness check is real)."""

import copy
import json
import sys

import pytest
import torch
from matplotlib.figure import Figure
from typer.testing import CliRunner

from swiglu_train.bench.moe.floor import floor_case
from swiglu_train.bench.moe.plot import plot_moe
from swiglu_train.bench.moe.report import merge_results, to_markdown
from swiglu_train.bench.moe.routing import HOT_EXPERT, group_sizes, make_routing
from swiglu_train.bench.moe.shapes import MODELS, parse_shapes, select_models
from swiglu_train.bench.moe.sonic import deinterleave, interleave
from swiglu_train.cli import app

runner = CliRunner()

# (D, F, E, k) from each repo's config.json
PUBLISHED = {
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "deepseek-v3": (7168, 2048, 256, 8),
    "llama4-scout": (5120, 8192, 16, 1),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}


def test_the_shape_table_is_the_published_configs():
    assert {m.name: (m.d, m.f, m.e, m.k) for m in MODELS} == PUBLISHED
    assert all(m.repo for m in MODELS)


def test_models_are_selected_by_name_and_custom_shapes_parsed():
    assert [m.name for m in select_models(["deepseek-v3", "mixtral-8x7b"])] == [
        "deepseek-v3",
        "mixtral-8x7b",
    ]
    with pytest.raises(ValueError, match="unknown models \\['gpt-5'\\]"):
        select_models(["gpt-5"])
    listed, custom = parse_shapes("2048,768,128,8; 32,16,4,2")
    assert listed.name == "qwen3-30b-a3b"
    assert (custom.name, custom.d, custom.f, custom.e, custom.k) == ("32x16-e4k2", 32, 16, 4, 2)
    for bad in ("32,16,4", "32,16,2,4", "a,b,c,d", ""):
        with pytest.raises(ValueError, match="--shapes"):
            parse_shapes(bad)


@pytest.mark.parametrize("kind", ["balanced", "skewed"])
@pytest.mark.parametrize(("tokens", "experts", "k"), [(64, 8, 2), (33, 6, 6), (10, 3, 1)])
def test_routings_give_distinct_choices_and_normalised_weights(kind, tokens, experts, k):
    indices, weights = make_routing(kind, tokens, experts, k, seed=3)
    assert indices.shape == weights.shape == (tokens, k)
    assert indices.dtype == torch.int64 and weights.dtype == torch.float32
    assert indices.min() >= 0 and indices.max() < experts
    assert all(len(set(row)) == k for row in indices.tolist())
    torch.testing.assert_close(weights.sum(1), torch.ones(tokens))
    again = make_routing(kind, tokens, experts, k, seed=3)
    assert torch.equal(again[0], indices) and torch.equal(again[1], weights)
    assert not torch.equal(make_routing(kind, tokens, experts, k, seed=4)[0], indices)
    assert int(group_sizes(indices, experts).sum()) == tokens * k


def test_skewed_routing_gives_half_the_first_choices_to_one_expert():
    indices, _ = make_routing("skewed", 1001, 16, 4, seed=0)
    first = indices[:, 0]
    assert int((first == HOT_EXPERT).sum()) == 1001 // 2
    others = torch.bincount(first[first != HOT_EXPERT], minlength=16)[1:]
    assert others.max() < 1001 // 4  # the rest spread over the other 15
    balanced, _ = make_routing("balanced", 1001, 16, 4, seed=0)
    assert int((balanced[:, 0] == HOT_EXPERT).sum()) < 1001 // 8


def test_routing_refuses_what_it_cannot_draw():
    for args, match in (
        (("uniform", 8, 4, 2), "unknown routing"),
        (("balanced", 8, 4, 5), "top-k"),
        (("skewed", 8, 1, 1), "at least 2 experts"),
    ):
        with pytest.raises(ValueError, match=match):
            make_routing(*args, seed=0)


def test_the_floor_runs_each_expert_s_gemms_on_its_own_rows():
    torch.manual_seed(0)
    t, d, f, e, k = 12, 8, 4, 3, 2
    x, grad_y = torch.randn(t, d), torch.randn(t, d)
    fc1, fc2 = torch.randn(e, 2 * f, d), torch.randn(e, d, f)
    indices, _ = make_routing("skewed", t, e, k, seed=1)
    case = floor_case(x, indices, fc1, fc2, grad_y)
    preact, _ = case.forward()
    order = indices.reshape(-1).argsort(stable=True)
    experts = indices.reshape(-1)[order]
    expected = torch.stack([fc1[ex] @ x[s // k] for ex, s in zip(experts, order, strict=True)])
    torch.testing.assert_close(preact, expected)
    case.backward(None)


def test_sonic_s_interleaved_rows_round_trip():
    fc1 = torch.arange(2 * 3 * 2 * 2.0).view(2, 6, 2)  # E=2, F=3, D=2
    rows = interleave(fc1)
    assert torch.equal(rows[0, 0::2], fc1[0, :3]) and torch.equal(rows[0, 1::2], fc1[0, 3:])
    assert torch.equal(deinterleave(rows), fc1)


def _bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "moe.json"
    result = runner.invoke(
        app,
        [
            "bench-moe",
            "--shapes",
            "32,16,4,2",
            "--tokens",
            "16",
            "--routing",
            "skewed",
            "--samples",
            "1",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "[1/1] 32x16-e4k2 skewed" in result.output
    return json.loads(out.read_text())


def test_a_tiny_run_checks_every_variant_against_the_loop(tmp_path):
    variants = "loop,normal,drop_h,drop_h_quack,hf_grouped_mm,torchtitan,sonicmoe"
    result = _bench(tmp_path, "--variants", variants)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["floor", "loop", "normal", "drop_h", "hf_grouped_mm", "torchtitan"]
    for name in ("normal", "drop_h", "hf_grouped_mm", "torchtitan"):
        row = rows[name]
        assert row["ok"], row
        assert 0 <= row["y_max_abs_err"] < 0.1
        for key in ("y", "grad_x", "grad_router", "grad_fc1", "grad_fc2"):
            assert 0 <= row[f"{key}_rel_err"] < 2e-2, (name, key)
        assert row["full_ms"] > 0 and row["full_over_floor"] > 0
    assert rows["loop"]["y_max_abs_err"] == 0
    # the size model's peak beside the measured one, for the drop_h impls only
    assert rows["drop_h"]["peak_model_MiB"] > 0
    assert not any("peak_model_MiB" in rows[name] for name in ("loop", "normal", "torchtitan"))
    skipped = {s["variant"]: s["reason"] for s in result["skipped"]}
    assert set(skipped) == {"drop_h_quack", "sonicmoe"}
    assert skipped["sonicmoe"].startswith("not installed")
    (point,) = result["points"]
    assert point["rows_per_expert"]["max"] >= 8  # the hot expert has half the first choices
    assert list(point["prepare_s"]) == variants.split(",")  # skipped ones too: failing costs
    assert all(seconds >= 0 for seconds in point["prepare_s"].values())
    # the first step (compiles, autotuning) of each variant built, within its preparation
    assert set(point["first_step_s"]) == set(rows) - {"floor"}
    assert all(0 <= s <= point["prepare_s"][v] for v, s in point["first_step_s"].items())
    assert point["reference_s"] >= 0
    meta = result["meta"]
    assert meta["variants"] == variants.split(",") and meta["reference"] == "loop"
    assert {"torch", "transformers", "torchtitan"} <= set(meta["versions"])
    markdown = (tmp_path / "moe.md").read_text()
    assert "| drop_h |" in markdown and "sonicmoe: not installed" in markdown
    assert f"| — (model {rows['drop_h']['peak_model_MiB']:.1f}) |" in markdown  # no CUDA peak
    assert (tmp_path / "moe.png").stat().st_size > 0

    # SonicMoE's run, in its own process, merged in: its rows added, its skip gone
    sonic = copy.deepcopy(result)
    sonic["meta"]["variants"] = ["sonicmoe"]
    sonic["rows"] = [rows["floor"], rows["loop"] | {"variant": "sonicmoe"}]
    sonic["skipped"] = []
    (tmp_path / "sonic.json").write_text(json.dumps(sonic))
    merged_path = tmp_path / "merged.json"
    merge = ["--merge", str(tmp_path / "moe.json"), "--merge", str(tmp_path / "sonic.json")]
    done = runner.invoke(app, ["bench-moe", *merge, "--out", str(merged_path)])
    assert done.exit_code == 0, done.output
    merged = json.loads(merged_path.read_text())
    assert [(r["variant"], r["run"]) for r in merged["rows"]][-1] == ("sonicmoe", 1)
    assert [s["variant"] for s in merged["skipped"]] == ["drop_h_quack"]
    assert "| sonicmoe |" in merged_path.with_suffix(".md").read_text()


def test_the_input_side_races_what_computes_it_against_its_own_loop(tmp_path):
    """--router-weights-on input (Llama-4): ours and transformers' Llama-4 experts (every
    expert on every token) are checked against the loop that scales each expert's input; a
    peer that weights the output is not offered, and the peak model, which leaves out the
    input side's buffers, gives no figure. Merging with an output-side run is refused."""
    variants = "loop,normal,drop_h,drop_h+gathered_wgrad,hf_llama4,torchtitan"
    result = _bench(tmp_path, "--variants", variants, "--router-weights-on", "input")
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["floor", "loop", "normal", "drop_h", "drop_h+gathered_wgrad", "hf_llama4"]
    for name in ("normal", "drop_h", "drop_h+gathered_wgrad", "hf_llama4"):
        assert rows[name]["ok"], rows[name]
        assert "peak_model_MiB" not in rows[name]
    skipped = {s["variant"]: s["reason"] for s in result["skipped"]}
    assert list(skipped) == ["torchtitan"]
    assert skipped["torchtitan"].startswith(
        "not offered: torchtitan applies the router weight to the expert output"
    )
    assert result["meta"]["router_weights_on"] == "input"
    assert "scales each expert's input (as Llama-4's does)" in (tmp_path / "moe.md").read_text()
    # on the output side, transformers' Llama-4 experts are not offered
    output = _bench(tmp_path / "out", "--variants", "loop,hf_llama4")
    assert output["skipped"][0]["reason"].startswith("not offered: hf_llama4 applies")
    with pytest.raises(ValueError, match="router_weights_on 'input' and 'output'"):
        merge_results([result, output])


def test_a_run_stopped_after_its_first_point_keeps_its_json_and_table(tmp_path, monkeypatch):
    """A device call killed at its limit (here, the second point raises) returns what finished:
    the JSON and the markdown are rewritten after every point, the plot only at the end."""
    from swiglu_train.bench.moe import harness

    real, calls = harness.measure_point, []

    def stopping(*args, **kwargs):
        calls.append(args[1].name)
        if len(calls) == 2:
            raise RuntimeError("killed at the call's time bound")
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "measure_point", stopping)
    out = tmp_path / "moe.json"
    args = ["bench-moe", "--shapes", "32,16,4,2;16,8,2,1", "--tokens", "8", "--routing",
            "balanced", "--samples", "1", "--warmup", "1", "--device", "cpu",
            "--variants", "drop_h", "--out", str(out)]  # fmt: skip
    stopped = runner.invoke(app, args)
    assert isinstance(stopped.exception, RuntimeError)
    assert calls == ["32x16-e4k2", "16x8-e2k1"]
    kept = json.loads(out.read_text())
    assert [(p["model"], p["routing"]) for p in kept["points"]] == [("32x16-e4k2", "balanced")]
    table = out.with_suffix(".md").read_text()
    assert "32x16-e4k2" in table and "| drop_h |" in table and "16x8-e2k1" not in table
    assert not out.with_suffix(".png").exists()


def _result(device: str = "NVIDIA H100 80GB HBM3") -> dict:
    point = {"model": "m", "routing": "balanced", "D": 4, "F": 2, "E": 2, "k": 1, "T": 8}
    point["rows_per_expert"] = {"min": 3, "max": 5, "mean": 4.0, "empty_experts": 0}
    row = {
        f"{p}_{s}": 1.5 for p in ("fwd", "bwd", "gpu", "host", "full") for s in ("ms", "over_floor")
    }
    rows = [
        row | {"model": "m", "routing": "balanced", "variant": v, "after_forward_MiB": mib,
               "peak_MiB": mib, "y_max_abs_err": 1e-3, "grad_x_rel_err": 1e-3, "ok": True}
        for v, mib in (("floor", None), ("drop_h", 10.0))
    ]  # fmt: skip
    meta = {"tokens": 8, "dtype": "bf16", "device_name": device, "commit": "abc", "samples": 30,
            "command": "swiglu-train bench-moe", "variants": ["drop_h"], "reference": "loop",
            "tolerance": {"others": 0.02, "+fp8": 0.05}, "versions": {}, "date": "d"}  # fmt: skip
    return {"meta": meta, "points": [point], "rows": rows, "skipped": []}


def test_the_report_reads_a_cuda_result_and_merge_refuses_another_gpu():
    result = _result()
    markdown = to_markdown(result)
    assert "on NVIDIA H100 80GB HBM3, commit abc" in markdown
    assert "| drop_h | 1.500 | 1.500 | 1.500 | 1.500 | 10.0 | 10.0 | 0.001 | 0.001 | yes |" in (
        markdown
    )
    assert isinstance(plot_moe(result), Figure)
    with pytest.raises(ValueError, match="device_name"):
        merge_results([result, _result("NVIDIA H200")])


def test_merging_a_merged_result_keeps_each_row_s_run():
    runs = []
    for variant in ("drop_h", "sonicmoe", "liger"):
        result = _result()
        result["meta"] |= {"variants": [variant], "command": f"run {variant}"}
        result["rows"][1]["variant"] = variant
        runs.append(result)
    merged = merge_results([merge_results(runs[:2]), runs[2]])
    assert [(r["variant"], r["run"]) for r in merged["rows"]] == [
        ("floor", 0),
        ("drop_h", 0),
        ("sonicmoe", 1),
        ("liger", 2),
    ]
    assert [run["command"] for run in merged["meta"]["runs"]] == [
        "run drop_h",
        "run sonicmoe",
        "run liger",
    ]
    assert merged["meta"]["variants"] == ["drop_h", "sonicmoe", "liger"]


def test_without_matplotlib_the_run_is_refused_before_it_starts(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails as missing
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    args = ["bench-moe", "--shapes", "32,16,4,2", "--device", "cpu", "--out", tmp_path / "m.json"]
    with pytest.raises(SystemExit) as exit_:
        app(args=[str(a) for a in args], prog_name="swiglu-train")
    assert exit_.value.code == 1
    assert "the [plot] extra brings it" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_step_that_waits_on_the_gpu_cannot_grow_the_queue_hold_without_bound():
    """A forward that syncs the host (the loop peer reads its group sizes) sees host time of at
    least the spin kernel's hold; before the cap, the hold doubled every sample (found on the
    H100: bench-moe's first point did not finish in 300 s)."""
    import torch

    from swiglu_train.bench.timing import MAX_HOLD_MS, Clock

    clock = Clock(torch.device("cpu"))
    clock.hold_ms = 10.0
    for _ in range(40):
        clock.saw_host(clock.hold_ms + 5.0)
    assert clock.hold_ms == MAX_HOLD_MS
