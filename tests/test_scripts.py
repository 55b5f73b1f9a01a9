"""Logic of the benchmark harnesses (benchmarks/*.py) that can be checked without a GPU."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("capacity", "limit"), [(1, 64), (5, 64), (37, 64), (64, 64), (100, 64)])
def test_micro_batch_search_finds_the_largest_fit(capacity, limit):
    search = load_script("max_micro_batch").largest_fitting
    calls = []

    def fits(n):
        calls.append(n)
        return n <= capacity

    best, tried = search(fits, limit)
    assert best == min(capacity, limit)
    assert tried == calls and len(calls) <= 2 * limit.bit_length() + 1


def test_micro_batch_search_when_nothing_fits():
    best, tried = load_script("max_micro_batch").largest_fitting(lambda n: False, 64)
    assert best == 0 and tried == [1]


def test_micro_batch_search_builds_drop_h_fp8_as_the_planner_names_it():
    model_config = load_script("max_micro_batch").model_config
    fp8, plain = model_config("1b", "drop_h+fp8").model, model_config("1b", "normal").model
    assert (fp8.mlp_impl, fp8.saved_fp8) == ("drop_h", True)
    assert (plain.mlp_impl, plain.saved_fp8) == ("normal", False)
    assert fp8.hidden_size == plain.hidden_size  # the same 1b model otherwise


def test_micro_batch_search_keeps_the_impls_that_finished_when_a_later_one_crashes(
    tmp_path, monkeypatch
):
    script = load_script("max_micro_batch")
    capacity = {"normal": 5, "drop_h": 7}

    def trainer(config, impl):
        if impl not in capacity:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return lambda n: n <= capacity[impl]

    monkeypatch.setattr(script, "trainer", trainer)
    monkeypatch.setattr(script.torch.cuda, "get_device_name", lambda: "test GPU")
    out = tmp_path / "mb.json"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        script.main("125m", "normal,drop_h,drop_h_quack+fp8", 64, "abc1234", out)
    payload = json.loads(out.read_text())
    assert [(r["impl"], r["max_micro_batch"]) for r in payload["results"]] == [
        ("normal", 5),
        ("drop_h", 7),
    ]
    assert payload["ratio_to_normal"] == {"normal": 1.0, "drop_h": 1.4}
    assert payload["commit"] == "abc1234" and payload["device_name"] == "test GPU"


def test_summarize_runs_pairs_rounds_and_writes_both_files(tmp_path, monkeypatch):
    summarize = load_script("summarize_runs")
    runs = {
        "normal_1": (100.0, 800.0),
        "drop_h_1": (99.0, 700.0),
        "normal_2": (200.0, 800.0),
        "drop_h_2": (202.0, 700.0),
        "drop_h+fp8_1": (95.0, 600.0),
        "drop_h@float8_1": (130.0, 650.0),
    }
    paths = []
    for name, (rate, after) in runs.items():
        path = tmp_path / f"pretrain_{name.replace('@', '_')}.json"
        impl, fp8 = name.rsplit("_", 1)[0].removesuffix("+fp8"), "+fp8" in name
        impl, _, float8 = impl.partition("@")
        summary = {"mlp_impl": impl, "saved_fp8": fp8, "tokens_per_s": rate}
        summary["float8"] = "tensorwise" if float8 else None
        summary["after_forward_MiB"] = after
        summary |= {"peak_MiB": 900.0, "initial_loss": 5.7, "final_loss": 3.0}
        path.write_text(json.dumps(summary))
        paths.append(str(path))
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    argv = ["x", *paths, "--title", "T", "--command", "c", "--commit", "abc", "--gpu", "G"]
    monkeypatch.setattr("sys.argv", [*argv, "--json", str(out_json), "--md", str(out_md)])
    summarize.main()
    payload = json.loads(out_json.read_text())
    rows = {r["mlp_impl"]: r for r in payload["rows"]}
    assert payload["meta"]["gpu"] == "G"
    # paired per round: 0.99 and 1.01, median 1.00; unpaired medians would give 150.5/150
    assert rows["drop_h"]["tokens_per_s_vs_normal"] == pytest.approx(1.0)
    assert rows["drop_h"]["rounds"] == 2 and rows["drop_h"]["after_forward_MiB"] == 700.0
    # an FP8-saved run is a row of its own, never a round of the bf16 impl's
    assert rows["drop_h+fp8"]["rounds"] == 1 and rows["drop_h+fp8"]["after_forward_MiB"] == 600
    assert rows["drop_h+fp8"]["tokens_per_s_vs_normal"] == pytest.approx(0.95)
    # and so is a run whose GEMMs ran on torchao's FP8 recipe, named as the bench variants are
    assert rows["drop_h_float8_tensorwise"]["tokens_per_s_vs_normal"] == pytest.approx(1.3)
    assert "| drop_h | 2 | 150 | 1.000 | 700.0 | 900.0 | 5.700 → 3.000 |" in out_md.read_text()
    assert not list(tmp_path.glob("*.tmp"))

    # --baseline pairs with another impl; without a CUDA device the GPU must be named
    monkeypatch.setattr("sys.argv", [*argv, "--json", str(out_json), "--md", str(out_md),
                                     "--baseline", "drop_h"])  # fmt: skip
    summarize.main()
    rows = {r["mlp_impl"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["normal"]["tokens_per_s_vs_normal"] == pytest.approx((100 / 99 + 200 / 202) / 2)
    assert rows["drop_h+fp8"]["tokens_per_s_vs_normal"] == pytest.approx(95 / 99)
    assert "÷ drop_h (paired)" in out_md.read_text()
    monkeypatch.setattr("sys.argv", [*argv[:-2], "--json", str(out_json), "--md", str(out_md)])
    with pytest.raises(SystemExit):
        summarize.main()

    # a run that measured no memory (on the CPU) reads "—", never a made-up number
    cpu = tmp_path / "pretrain_stock_1.json"
    cpu.write_text(json.dumps({"mlp_impl": "stock", "saved_fp8": False, "tokens_per_s": 50.0,
                               "after_forward_MiB": None, "peak_MiB": None,
                               "initial_loss": 5.7, "final_loss": 5.6}))  # fmt: skip
    monkeypatch.setattr("sys.argv", ["x", str(cpu), paths[0], "--title", "T", "--command", "c",
                                     "--commit", "abc", "--gpu", "cpu", "--baseline", "stock",
                                     "--json", str(out_json), "--md", str(out_md)])  # fmt: skip
    summarize.main()
    rows = {r["mlp_impl"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["stock"]["after_forward_MiB"] is None
    assert rows["normal"]["tokens_per_s_vs_normal"] == pytest.approx(2.0)
    assert "| stock | 1 | 50 | 1.000 | — | — | 5.700 → 5.600 |" in out_md.read_text()


def test_probe_result_records_where_and_how_it_was_measured(tmp_path, monkeypatch):
    import torch

    from swiglu_train.bench.results import write_probe_result

    monkeypatch.setattr("sys.argv", ["probe.py", "--models", "7b", "--json", "out.json"])
    rows = [{"M": 1, "ratio": 1.5}]
    md = tmp_path / "out.md"
    result = write_probe_result(
        "benchmarks/probe.py", rows, 30, "abc1234", str(tmp_path / "out.json"), str(md),
        lambda r: f"{len(r['rows'])} row at {r['commit']}\n", torch.device("cpu"),
    )  # fmt: skip
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved == result and saved["rows"] == rows and saved["samples"] == 30
    assert saved["command"] == "python benchmarks/probe.py --models 7b --json out.json"
    assert saved["commit"] == "abc1234" and saved["gpu"] == "cpu"
    assert md.read_text() == "1 row at abc1234\n"


def test_a_device_session_s_commit_wins_over_the_copied_tree_s_head(tmp_path, monkeypatch):
    """The device copies the working tree with a .git that may be another commit's."""
    import torch

    from swiglu_train.bench.results import write_probe_result

    monkeypatch.setenv("SWIGLU_TRAIN_COMMIT", "9e25753")
    result = write_probe_result(
        "benchmarks/probe.py", [], 30, None, str(tmp_path / "out.json"), None, str,
        torch.device("cpu"),
    )  # fmt: skip
    assert result["commit"] == "9e25753"
    monkeypatch.delenv("SWIGLU_TRAIN_COMMIT")
    head = write_probe_result(
        "benchmarks/probe.py", [], 30, None, str(tmp_path / "out.json"), None, str,
        torch.device("cpu"),
    )["commit"]  # fmt: skip
    assert head != "9e25753" and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", head)  # HEAD


def test_a_tree_that_differs_from_its_head_is_recorded_dirty(tmp_path, monkeypatch):
    """As the device box's copied tree does from its older .git; an untracked file is not."""
    import subprocess

    from swiglu_train.bench.results import git_commit

    monkeypatch.delenv("SWIGLU_TRAIN_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert git_commit() == head.strip()
    (tmp_path / "log").write_text("untracked\n")
    assert git_commit() == head.strip()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit() == head.strip() + "+dirty"


def test_fp8_accuracy_script_measures_each_format_against_float64():
    """benchmarks/measure_fp8_saved.py on the CPU at one small shape: every format's errors, the
    FP8 path's bigger than bf16's (e4m3 rounding) but bounded, and bf16's at its rounding."""
    probe = load_script("measure_fp8_saved")
    rows = probe.measure([(64, 32, 160)], ["normal"], seed=0)  # F 160: a partial block
    errors = {r["format"]: r for r in rows}
    assert set(errors) == {"bf16", "fp8", "fp8_fp32", "fp8_pow2", "fp8_row", "e5m2", "int8",
                           "save_factors", "save_factors_fp8"}  # fmt: skip
    # the factors in fp8: their own rounding on grad_x, grad_W1; grad_W2 reads the bf16 h
    assert errors["save_factors"]["grad_x"] < 0.01 < errors["save_factors_fp8"]["grad_x"] < 0.08
    assert errors["save_factors_fp8"]["grad_W2"] < 0.01
    for key in ("grad_x", "grad_W1", "grad_W2"):
        assert errors["bf16"][key] < 0.01 < errors["fp8"][key] < 0.08, key
        assert errors["fp8"][key] < errors["e5m2"][key], key
    assert errors["fp8"]["y"] == errors["bf16"]["y"]  # forward's h comes from the bf16 preact
    # int8's uniform steps beat e4m3 on unit-normal blocks, yet stay over bf16's rounding
    for key in ("grad_x", "grad_W1", "grad_W2"):
        assert errors["bf16"][key] < errors["int8"][key] < errors["fp8"][key] / 2, key
    # but where a few features dominate, their blocks' uniform steps flatten the rest: e4m3's
    # relative steps keep them, which is why the format is e4m3
    rows = probe.measure([(64, 32, 160)], ["outlier features"], seed=0)
    outliers = {r["format"]: r for r in rows}
    for key in ("grad_x", "grad_W1", "grad_W2"):
        assert outliers["int8"][key] > 2 * outliers["fp8"][key], key


def test_resume_check_compares_the_steps_both_runs_logged(tmp_path):
    full, resumed = tmp_path / "full.log", tmp_path / "resumed.log"
    full.write_text("step 1 loss 5.0\nstep 2 loss 4.0\nstep 3 loss 3.0\nnoise\n")
    resumed.write_text("loading\nstep 3 loss 3.3\nstep 4 loss 2.0\n")
    out = tmp_path / "checks.jsonl"
    for label in ("a", "b"):
        load_script("resume_check").main([str(full), str(resumed), label, "--out", str(out)])
    checks = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["label"] for c in checks] == ["a", "b"]  # appended, one line a check
    assert checks[0]["rel_diff"] == {"3": pytest.approx(0.1)}  # step 4: no full-run loss


def test_device_count_comparison_pairs_each_impl_s_runs(tmp_path):
    def run(gpus, impl, losses, rate):
        summary = {"mlp_impl": impl, "losses": losses, "tokens_per_s": rate}
        summary |= {"after_forward_MiB": 100.0 / gpus, "peak_MiB": 200.0 / gpus}
        (tmp_path / f"lightning_{gpus}gpu_{impl}.json").write_text(json.dumps(summary))

    run(4, "drop_h", {"0": 5.0, "1": 4.0, "2": 3.5}, 400.0)
    run(1, "drop_h", {"0": 5.0, "1": 4.1}, 100.0)
    run(4, "normal", {"0": 5.0}, 380.0)  # no 1-GPU run: left out
    out = tmp_path / "cmp.json"
    load_script("compare_device_counts").main([str(tmp_path), "--json", str(out)])
    rows = json.loads(out.read_text())
    assert list(rows) == ["drop_h"]
    row = rows["drop_h"]
    assert row["steps"] == 2 and row["max_abs_loss_diff"] == pytest.approx(0.1)
    assert row["tokens_per_s_4gpu"] == 400.0 and row["peak_MiB_1gpu"] == 200.0


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_experts_wgrad_calls_make_one_gradient_and_its_table_names_each(routing):
    """The three timed calls of benchmarks/experts_wgrad.py compute the same grad_W1 (here on
    CPU: the Triton GEMM through the interpreter where it is on, else its gathered twin)."""
    import torch

    from swiglu_train.bench.moe.shapes import MoEShape

    script = load_script("experts_wgrad")
    shape = MoEShape("tiny", "", 32, 24, 4, 2)
    ops = script.operands(shape, routing, 40, torch.device("cpu"))
    outs = {name: fn().float() for name, fn in script.calls(ops).items()}
    assert set(outs) == set(script.CALLS)
    floor = outs[script.FLOOR]
    assert floor.shape == (4, 48, 32) and floor.norm() > 0
    for name, out in outs.items():  # bf16 outputs; the interpreter truncates its rounding
        assert ((out - floor).norm() / floor.norm()).item() < 2**-7, name
    row = {"model": "tiny", "routing": routing, "call": "gathered_triton", "ms": 0.5,
           "over_floor": 1.25, "extra_MiB": 0.0, "rel_err_vs_floor": 1e-3}  # fmt: skip
    table = script.to_markdown({"gpu": "H100", "commit": "abc", "samples": 30, "rows": [row]})
    assert "| tiny | " + routing + " | gathered_triton | 0.500 | 1.250 | 0 | 1.0e-03 |" in table
