"""benchmarks/fit_inference_dispatch_rule.py on synthetic bench-inference results."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fit_inference_dispatch_rule.py"
MS = (1, 16, 128, 512)
SHAPES = {"a": (896, 4864), "b": (3584, 18944), "c": (8192, 29568)}


def _script():
    spec = importlib.util.spec_from_file_location("fit_inference_dispatch_rule", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through its module
    spec.loader.exec_module(module)
    return module


def _results(gated_last_m: int) -> dict:
    """Three models where the gated GEMM is fastest up to ``gated_last_m`` rows and quack
    beyond, cuBLAS second there; the fused MLP 1.1x up to 16 rows, 3x beyond; plus the run's
    own table."""
    fit, rows, shapes = _script(), [], {}
    for model, (d, f) in SHAPES.items():
        for kind, m in ((k, m) for k in ("gated", "mlp") for m in MS):
            small = m <= gated_last_m
            ms = {"gated": 1.0 if small else 1.3, "cublas": 1.2, "quack": 1.5 if small else 1.0}
            ms |= {"fused_mlp": 1.1 if m <= 16 else 3.0} if kind == "mlp" else {}
            names = fit.CANDIDATES[kind]
            rows.append({"table": kind, "model": model, "M": m, "K": d, "N": f}
                        | {f"{names[p]}_ms": v for p, v in ms.items()})  # fmt: skip
            entry = {"path": "gated"} if small else {"path": "quack", "fallback": "cublas"}
            shapes.setdefault(f"{d}x{f}", {}).setdefault(kind, {})[str(m)] = entry
    return {"gpu": "synthetic", "commit": "test", "command": "test", "rows": rows,
            "dispatch": shapes}  # fmt: skip


def test_the_rule_moves_its_crossover_with_the_ridge():
    rule = _script().Rule(small_m_per_ridge=0.25, fused_max_m=1)
    # more bandwidth per FLOP (a lower ridge): the weight-bound regime, and the gated GEMM, end
    # at a smaller M
    assert rule.choose("gated", 40, ridge=200, quack=True) == "gated"
    assert rule.choose("gated", 40, ridge=100, quack=True) == "quack"
    assert rule.choose("gated", 40, ridge=100, quack=False) == "cublas"
    assert rule.choose("mlp", 1, ridge=200, quack=True) == "fused_mlp"
    assert rule.choose("gated", 1, ridge=200, quack=True) == "gated"  # fused serves mlp only


def test_the_fit_brackets_the_crossover_between_the_measured_ms():
    fit = _script()
    for last, nxt in ((16, 128), (128, 512)):
        rule = fit.fit(fit.points(_results(last)), ridge=200)
        assert last < rule.small_m_per_ridge * 200 < nxt
        assert rule.fused_max_m == 0  # 1.1x the gated GEMM wherever it runs


def test_the_fit_script_reports_leave_one_model_out(tmp_path):
    results = tmp_path / "run.json"
    results.write_text(json.dumps(_results(16)))
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--results", str(results), "--judge", str(results),
         "--ridge", "200", "--json", str(out), "--md", str(md)],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    rule = result["leave_one_model_out"]["rule"]["summary"]
    assert rule["points"] == 2 * len(MS) * len(SHAPES)
    assert rule["max"] == rule["max_no_quack"] == 1.0  # the synthetic best path every time
    assert result["leave_one_model_out"]["table"]["summary"]["max"] == 1.0
    assert result["ships"] is True
    assert result["judged"][0]["rerun_spread"]["median"] == 0.0
    assert result["in_sample"]["defaults"]["max"] == 1.3  # gated at 128 and 512 where quack wins
    assert "fit_inference_dispatch_rule.py --results" in md.read_text()
    assert "Ships in place of the table: yes" in md.read_text()
