"""compare-memory end to end on two tiny offline W&B runs: loading, report, workspace, notebook.

The runs are real (``wandb.init`` offline, read back through ``wandb leet inspect``) and their
CSVs come from the real sink. ``normal`` logs the CUDA-only keys and ``drop_h`` does not, so the
allocator and the saved-bytes paths of every panel both run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.memory.csv_log import MemoryCsv
from swiglu_train.memory.runs import MemoryRun, depth_curve, layer_key, load_run, load_runs

# the notebook extra; the GPU box lacks it, and this file has no GPU tests
nbformat = pytest.importorskip("nbformat")
wandb = pytest.importorskip("wandb")
write_kernel_spec = pytest.importorskip("ipykernel.kernelspec").write_kernel_spec
NotebookClient = pytest.importorskip("nbclient").NotebookClient
pytest.importorskip("wandb_workspaces")
from swiglu_train.memory.workspace import build_workspace  # noqa: E402 (after the skip)

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "compare_memory_curves.ipynb"
LAYERS, STEPS = 3, 4
MLP_MIB = {"normal": 913.5, "drop_h": 609.0}  # per MLP at the README's Qwen-7B-like shape


def step_metrics(impl: str, step: int, cuda: bool) -> dict[str, float]:
    """The schema's keys with plausible values; step / 3 makes floats that must round-trip."""
    out: dict[str, float] = {}
    cumulative = 0.0
    for i in range(LAYERS):
        saved = MLP_MIB[impl] + 250.0 + step / 3
        cumulative += saved
        out[layer_key(i, "saved_MiB")] = saved
        out[layer_key(i, "cumulative_saved_MiB")] = cumulative
        out[layer_key(i, "mlp_saved_MiB")] = MLP_MIB[impl]
        if cuda:
            out[layer_key(i, "allocated_MiB")] = cumulative + 64.0
    out["memory/saved_MiB"] = cumulative
    out[f"memory/impl/{impl}/saved_MiB"] = MLP_MIB[impl] * LAYERS
    if cuda:
        out["memory/after_forward_MiB"] = cumulative + 64.0
        out["memory/forward_peak_MiB"] = cumulative + 512.0
        out["memory/backward_peak_MiB"] = cumulative + 1024.0 + step
        out["memory/peak_MiB"] = cumulative + 1024.0 + step
        out["memory/allocated_MiB"] = 14_000.0
    return out


def tiny_run(root: Path, impl: str, cuda: bool) -> Path:
    run = wandb.init(
        mode="offline",  # explicit: wandb's settings singleton may predate WANDB_MODE here
        dir=root,
        project="swiglu-train-test",
        group="tiny",
        name=f"tiny-{impl}",
        config={"mlp_impl": impl, "num_layers": LAYERS, "device": "cuda" if cuda else "cpu"},
        settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True),
    )
    run.define_metric("memory/step")
    run.define_metric("memory/*", step_metric="memory/step", summary="max")
    run_dir = Path(run.dir).parent
    sink = MemoryCsv(run_dir / "memory.csv")
    for step in range(STEPS):
        metrics = step_metrics(impl, step, cuda)
        run.log({**metrics, "memory/step": step})
        sink.write(step, metrics)
        run.log({"train/loss": 4.0 / (step + 1)})  # a row without memory keys, as in training
    run.finish()
    return run_dir


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        return {impl: tiny_run(root, impl, cuda=impl == "normal") for impl in MLP_MIB}


@pytest.fixture(scope="module")
def runs(run_dirs: dict[str, Path]) -> dict[str, MemoryRun]:
    return {impl: load_run(path) for impl, path in run_dirs.items()}


def test_wandb_run_and_csv_give_the_same_series(run_dirs, runs) -> None:
    for impl, run in runs.items():
        from_csv = load_run(run_dirs[impl] / "memory.csv")
        assert run.steps == from_csv.steps == list(range(STEPS))  # memory/step, not _step
        assert run.series == from_csv.series
        assert run.series["memory/saved_MiB"][1] == step_metrics(impl, 1, False)["memory/saved_MiB"]
        assert run.label == impl and run.config["num_layers"] == LAYERS
        assert run.step_key == "memory/step" and run.name == f"tiny-{impl}"
    log_file = next(run_dirs["drop_h"].glob("*.wandb"))
    assert load_run(log_file).series == runs["drop_h"].series
    assert "memory/peak_MiB" not in runs["drop_h"].series


def test_depth_curve_prefers_allocator_figures(runs) -> None:
    layers, values, key = depth_curve(runs["normal"])
    assert (layers, key) == (list(range(LAYERS)), "allocated_MiB")
    layers, values, key = depth_curve(runs["drop_h"])
    assert (layers, key) == (list(range(LAYERS)), "cumulative_saved_MiB")
    assert values == sorted(values) and values[-1] == runs["drop_h"].last("memory/saved_MiB")
    assert depth_curve(runs["drop_h"], step=0)[1][0] == MLP_MIB["drop_h"] + 250.0


def test_labels_disambiguate_shared_impls(run_dirs) -> None:
    csv = run_dirs["drop_h"] / "memory.csv"
    loaded = load_runs([run_dirs["normal"], f"mine={csv}", run_dirs["normal"], csv])
    assert [r.label for r in loaded] == [
        "normal (tiny-normal)",
        "mine",
        "normal (tiny-normal)",
        run_dirs["drop_h"].name,  # a CSV is named after its directory
    ]


def test_compare_memory_cli_writes_png_and_html(run_dirs, tmp_path: Path) -> None:
    out = tmp_path / "report" / "memory.png"
    args = ["compare-memory", str(run_dirs["normal"]), f"drop_h={run_dirs['drop_h']}/memory.csv"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    page = out.with_suffix(".html").read_text()
    assert "<svg" in page and "normal" in page and "drop_h" in page
    assert "<script" not in page and "<link" not in page
    assert sorted(p.name for p in out.parent.iterdir()) == ["memory.html", "memory.png"]


def test_compare_memory_cli_errors(run_dirs, tmp_path: Path) -> None:
    out = str(tmp_path / "memory.png")
    missing = CliRunner().invoke(app, ["compare-memory", str(tmp_path / "gone"), "--out", out])
    assert missing.exit_code == 2 and "run not found" in missing.output
    csv = str(run_dirs["drop_h"] / "memory.csv")
    logged_out = {"WANDB_API_KEY": None, "HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
    saved = CliRunner().invoke(
        app,
        ["compare-memory", csv, "--out", out, "--wandb-workspace", "e/p"],
        env={**logged_out, "WANDB_CONFIG_DIR": str(tmp_path)},  # fails fast, before any network
    )
    assert saved.exit_code == 1 and "could not save the W&B workspace to e/p" in saved.output
    assert Path(out).stat().st_size > 0 and Path(out).with_suffix(".html").exists()


def test_workspace_lays_out_the_memory_keys(runs) -> None:
    workspace = build_workspace("swiglu-team/swiglu-train", list(runs.values()))
    plotted = {s.name: [y for p in s.panels for y in p.y] for s in workspace.sections}
    assert {"memory/saved_MiB", "memory/peak_MiB"} <= set(plotted["Memory per step"])
    assert set(plotted["Memory per MLP impl"]) == {
        "memory/impl/normal/saved_MiB",
        "memory/impl/drop_h/saved_MiB",
    }
    per_layer = workspace.sections[-1].panels
    assert [p.title for p in per_layer] == [f"layer {i}" for i in range(LAYERS)]
    assert layer_key(2, "cumulative_saved_MiB") in per_layer[2].y
    assert {p.x for s in workspace.sections for p in s.panels} == {"memory/step"}
    assert (workspace.entity, workspace.project) == ("swiglu-team", "swiglu-train")
    assert [g.name for g in workspace.runset_settings.groupby] == ["Group", "mlp_impl"]
    with pytest.raises(ValueError, match="expected ENTITY/PROJECT"):
        build_workspace("swiglu-train", list(runs.values()))


def test_clear_errors(run_dirs, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"run not found: .*offline-run-gone"):
        load_run(tmp_path / "wandb" / "offline-run-gone")
    with pytest.raises(ValueError, match=r"not a W&B run directory.*run directories inside it"):
        load_run(run_dirs["normal"].parent)  # the wandb/ directory holding both runs
    no_memory = tmp_path / "loss.csv"
    no_memory.write_text("step,train/loss,lr\n0,3.2,0.001\n")
    with pytest.raises(ValueError, match=r"no memory metrics .* it has: lr, train/loss\."):
        load_run(no_memory)


def test_notebook_executes_against_the_runs(run_dirs, tmp_path: Path, monkeypatch) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the outputs"
    write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")  # runs this interpreter
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    specs = [str(run_dirs["normal"]), f"drop_h={run_dirs['drop_h']}/memory.csv"]
    monkeypatch.setenv("SWIGLU_RUNS", os.pathsep.join(specs))
    client = NotebookClient(
        nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    data = [o.get("data", {}) for c in code for o in c.outputs]
    assert any("image/png" in d for d in data)
    assert any("drop_h" in d.get("text/html", "") for d in data)


def test_a_resumed_run_s_segments_join_into_one_series(tmp_path, monkeypatch) -> None:
    """Offline, a W&B run resumed by id writes a second run directory of the same id; its steps
    from the resume on (logged again) replace the first segment's, whichever order they are
    listed in. Two labels for one run are refused."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    segments = []
    for steps, offset in ((range(4), 0.0), (range(2, 6), 100.0)):  # resumed at step 2
        run = wandb.init(mode="offline", dir=tmp_path, project="t", id="resumed1",
                         resume="allow", config={"mlp_impl": "drop_h"},
                         settings=wandb.Settings(console="off", x_disable_stats=True))  # fmt: skip
        for step in steps:
            run.log({"memory/saved_MiB": step + offset, "trainer/global_step": step})
        run.finish()
        segments.append(Path(run.dir).parent)
    assert segments[0] != segments[1]
    for listed in (segments, segments[::-1]):
        [joined] = load_runs(listed)
        assert joined.label == "drop_h" and joined.run_id == "resumed1"
        assert joined.steps == list(range(6))
        assert joined.series["memory/saved_MiB"] == [0.0, 1.0, 102.0, 103.0, 104.0, 105.0]
    with pytest.raises(ValueError, match=r"\['a', 'b'\] label segments of one resumed W&B run"):
        load_runs([f"a={segments[0]}", f"b={segments[1]}"])
    [named] = load_runs([f"mine={segments[0]}", segments[1]])
    assert named.label == "mine" and named.steps == list(range(6))
