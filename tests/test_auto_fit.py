"""The fit of auto's cost model: known terms recovered from synthetic rows, refusals, and the
shipped models reproduced from the committed H200 and H100 grids."""

import copy
import json
from pathlib import Path

import pytest

from swiglu_train.layers.auto import resolve
from swiglu_train.layers.auto_fit import fit_auto_model
from swiglu_train.layers.auto_model import MIB, AutoModel

ROOT = Path(__file__).resolve().parents[1]


def ship_command(gpu: str) -> str:
    """The command each shipped model records: the committed grid merged onto itself."""
    grid = f"benchmarks/results/grid/grid_{gpu}"
    return (
        f"swiglu-train bench-grid --merge {grid}.json --json {grid}.json --md {grid}.md "
        f"--plot {grid}.png --auto-model swiglu_train/layers/auto_{gpu}.json"
    )


TFLOPS = 800.0
# impl -> (c, a, host_ms, after-forward bytes per M·D, per M·F)
TERMS = {
    "normal": (1.01, 160.0, 1.7, 2.0, 6.0),
    "drop_h": (1.012, 190.0, 1.6, 2.0, 4.0),
    "save_factors_quack": (1.03, 40.0, 1.5, 2.0, 6.0),
}
SHAPES = [(1024, 4096), (2048, 8192), (4096, 14336), (8192, 28672)]
MS = (1024, 4096, 16384)


def synthetic(terms: dict = TERMS, shapes=SHAPES, ms=MS) -> dict:
    """A grid result an H200 could have measured, from known terms. Where a step is
    host-bound, the GPU's events also time the gaps the host leaves (gpu_ms reads high) and
    the floor may time its host too: the fit must not learn from either."""
    rows = []
    for d, f in shapes:
        for m in ms:
            floor_ms = 18 * m * d * f / (TFLOPS * 1e9)
            steps = {n: ((c + a / d) * floor_ms, host) for n, (c, a, host, *_) in terms.items()}
            host_bound = any(gpu < host for gpu, host in steps.values())
            for name, (*_, host, per_md, per_mf) in terms.items():
                gpu = steps[name][0]
                if gpu < host:
                    gpu = (gpu + host) / 2  # gaps timed, still below host
                rows.append(
                    {
                        "M": m, "D": d, "F": f, "variant": name,
                        "gpu_ms": gpu, "host_ms": host, "ms": max(gpu, host),
                        "floor_ms": max(floor_ms, 1.0) if host_bound else floor_ms,
                        "after_forward_MiB": (per_md * m * d + per_mf * m * f) / MIB,
                    }
                )  # fmt: skip
    rows.append({**rows[0], "variant": "liger", "gpu_ms": 1e-3})  # a peer: not fitted
    meta = {
        "gpu_family": "H200", "device_name": "NVIDIA H200", "commit": "abc1234",
        "dtype": "bf16", "command": "swiglu-train bench-grid --json grid.json",
    }  # fmt: skip
    return {"meta": meta, "rows": rows}


def test_the_fit_recovers_known_terms():
    result = synthetic()
    fitted = fit_auto_model(result, "swiglu-train bench-grid --auto-model a.json")
    assert fitted["floor_tflops"] == pytest.approx(TFLOPS, rel=1e-5)
    assert fitted["command"] == "swiglu-train bench-grid --auto-model a.json"
    assert fitted["measured_with"] == "swiglu-train bench-grid --json grid.json"
    assert fitted["commit"] == "abc1234" and fitted["gpu_family"] == "H200"
    assert list(fitted["impls"]) == ["normal", "drop_h", "save_factors_quack"]  # registry order
    assert len(fitted["points"]) == len(SHAPES) * len(MS)
    host_bound = {(r["M"], r["D"]) for r in result["rows"] if r["gpu_ms"] < r["host_ms"]}
    assert host_bound  # the synthetic grid has host-bound points to leave out
    for name, (c, a, host, per_md, per_mf) in TERMS.items():
        impl = fitted["impls"][name]
        assert impl["c"] == pytest.approx(c, rel=1e-5)
        assert impl["a"] == pytest.approx(a, rel=1e-5)
        assert impl["host_ms"] == host
        assert (impl["after_forward_per_md"], impl["after_forward_per_mf"]) == (per_md, per_mf)
        gpu_bound = sum(r["variant"] == name and r["gpu_ms"] > host for r in result["rows"])
        assert impl["gpu_points"] == gpu_bound
    AutoModel.from_dict(fitted)


def test_the_fitted_model_picks_as_its_terms_say():
    """Host-bound at the smallest shape (save_factors_quack has the least host work), the
    quack impl at small D (its activation share is a fifth), normal at large D."""
    model = AutoModel.from_dict(fit_auto_model(synthetic(), "fit"))
    picks = {
        dims: resolve(*dims, "NVIDIA H200", model, quack=True).impl
        for dims in [(1024, 1024, 4096), (16384, 1024, 4096), (16384, 8192, 28672)]
    }
    assert picks == {
        (1024, 1024, 4096): "save_factors_quack",
        (16384, 1024, 4096): "save_factors_quack",
        (16384, 8192, 28672): "normal",
    }
    no_quack = resolve(16384, 1024, 4096, "NVIDIA H200", model, quack=False)
    assert no_quack.impl == "normal"  # 1.166x; drop_h 1.198x: beyond the 0.5 % tie


def test_crossover_rows_fit_alike():
    """bench-crossover's rows name the impl ``impl``, not ``variant``; the model is the same."""
    grid = synthetic()
    crossover = copy.deepcopy(grid)
    for r in crossover["rows"]:
        r["impl"] = r.pop("variant")
    assert fit_auto_model(crossover, "fit") == fit_auto_model(grid, "fit")


def test_a_result_without_cuda_readings_is_refused():
    result = synthetic()
    result["meta"]["gpu_family"] = None
    with pytest.raises(ValueError, match=r"needs CUDA readings .* measured off CUDA"):
        fit_auto_model(result, "fit")
    result = synthetic()
    result["rows"][4]["after_forward_MiB"] = None
    with pytest.raises(ValueError, match=r"row M=\d+ D=1024 F=4096 drop_h: after_forward_MiB"):
        fit_auto_model(result, "fit")


def test_the_old_crossover_run_without_gpu_and_host_time_is_refused():
    old = json.loads((ROOT / "benchmarks/results/grid/crossover_h200.json").read_text())
    with pytest.raises(ValueError, match="gpu_ms is None; an auto model needs every row's"):
        fit_auto_model(old, "fit")


def test_too_few_shapes_to_fit_say_why():
    with pytest.raises(ValueError, match=r"normal: GPU-bound points .* c \+ a/D needs two D"):
        fit_auto_model(synthetic(shapes=SHAPES[3:]), "fit")
    with pytest.raises(ValueError, match="no point where every impl is GPU-bound"):
        fit_auto_model(synthetic(shapes=SHAPES[:1], ms=(1024,)), "fit")


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_the_shipped_model_is_the_fit_of_the_committed_grid(gpu):
    """Reproducible: the command in the file refits it from the committed JSON."""
    grid = json.loads((ROOT / f"benchmarks/results/grid/grid_{gpu}.json").read_text())
    shipped = json.loads((ROOT / f"swiglu_train/layers/auto_{gpu}.json").read_text())
    assert shipped["command"] == ship_command(gpu)
    assert fit_auto_model(grid, ship_command(gpu)) == shipped
    assert shipped["commit"] == grid["meta"]["commit"]
    assert shipped["measured_with"] == grid["meta"]["command"]
