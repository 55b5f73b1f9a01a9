"""benchmarks/sweep_moe_gemm_configs.py on CPU: its candidates keep quack's rules, its operands
are the GEMMs experts_quack runs and its torch._grouped_mm twins the same GEMMs
(moe_gemm_candidates.py), and its markdown reads the best config off the rows
(moe_gemm_report.py)."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from swiglu_train.bench.moe.routing import ROUTINGS
from swiglu_train.bench.moe.shapes import MoEShape

ROOT = Path(__file__).resolve().parents[1]
SM90_DEFAULT = "128x192-pp-2x1-static"  # quack 0.6.5's _default_config_for_cap(9)
SHAPE = MoEShape("small", "", 24, 16, 5, 2)  # D, F, E, k
TOKENS = 32


def load_lab(name: str) -> ModuleType:
    """A module of benchmarks/, imported with that folder first on the path, as ``python3
    benchmarks/sweep_moe_gemm_configs.py`` puts it: the script imports its siblings by name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def sweep():
    """The sweep's configs, candidates and operands."""
    return load_lab("moe_gemm_candidates")


@pytest.fixture(scope="module")
def report():
    return load_lab("moe_gemm_report")


def test_the_script_runs_its_siblings_candidates_and_report(sweep, report):
    script = load_lab("sweep_moe_gemm_configs")
    assert script.candidates is sweep.candidates and script.operands is sweep.operands
    assert script.rows_of is report.rows_of and script.to_markdown is report.to_markdown


def chosen(sweep, gemm: str, limit: int = 12) -> list:
    configs = [sweep.Config.parse(c) for c in (*sweep.CONFIGS, SM90_DEFAULT)]
    return sweep.candidates(gemm, configs, sweep.Config.parse(SM90_DEFAULT), limit)


def test_each_gemm_s_candidates_keep_quack_s_rules_and_leave_out_the_default(sweep):
    for gemm in sweep.GEMMS:
        mine = chosen(sweep, gemm)
        assert 0 < len(mine) <= 12 and sweep.Config.parse(SM90_DEFAULT) not in mine
        assert not any(c.swap_ab for c in mine)  # every GEMM here is varlen_m or gathered
        if gemm in sweep.GATHERED:
            assert all(c.cluster_n == 1 and not c.dynamic and c.tile_n != 208 for c in mine)
        else:  # where the dynamic scheduler can run, it is measured
            assert any(c.dynamic for c in mine)
    assert len(chosen(sweep, "fc2", limit=3)) == 3


def test_the_candidates_vary_every_axis_the_rule_is_to_be_fitted_on(sweep):
    mine = {c for gemm in sweep.GEMMS for c in chosen(sweep, gemm)}
    assert {c.tile_m for c in mine} == {128, 192, 256}
    assert {c.tile_n for c in mine} == {64, 96, 128, 160, 192, 208, 256}
    assert {c.pingpong for c in mine} == {True, False}
    assert {c.cluster_m for c in mine} == {1, 2}
    assert {c.dynamic for c in mine} == {True, False}


@pytest.mark.parametrize(
    ("label", "gemm", "why"),
    [
        ("128x192-pp-1x2-static", "fc1", "cluster_n"),
        ("128x208-pp-2x1-static", "grad_W1", "208"),
        ("128x192-pp-2x1-dynamic", "grad_h", "dynamic"),
        ("128x192-pp-2x1-static-swap", "fc2", "swap_ab"),
        ("192x160-pp-2x1-static", "fc2", "past 128"),
        ("192x256-coop-2x1-static", "grad_xg", "past 224"),
        ("256x256-coop-2x1-static", "fc2", "past 208"),
        ("192x112-coop-2x1-static", "fc2", "multiple of 32"),
        ("128x120-pp-2x1-static", "fc2", "multiple of 16"),
        ("64x128-pp-2x1-static", "fc2", "not swept"),
    ],
)
def test_a_config_quack_cannot_run_is_refused_with_its_reason(sweep, label, gemm, why):
    assert why in sweep.unsupported(sweep.Config.parse(label), gemm)


def test_what_only_gathering_forbids_runs_on_the_gemms_that_do_not_gather(sweep):
    for label in ("128x192-pp-1x2-static", "128x208-pp-2x1-static", "128x192-pp-2x1-dynamic"):
        config = sweep.Config.parse(label)
        assert [g for g in sweep.GEMMS if sweep.unsupported(config, g) is None] == [
            "fc2",
            "grad_xg",
        ]


def test_a_label_names_its_config_and_a_bad_one_is_refused(sweep):
    for label in (*sweep.CONFIGS, "128x192-pp-2x1-static-swap"):
        assert sweep.Config.parse(label).label == label
    c = sweep.Config.parse("256x128-coop-1x1-dynamic")
    assert (c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n, c.dynamic) == (
        256, 128, False, 1, 1, True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="expected"):
        sweep.Config.parse("128x192-pp")


def as_quack(op) -> torch.Tensor:
    """What quack computes from (a, b, varlen), per expert: A's rows (varlen_m) or columns
    (varlen_k) of the expert's slice, read through A_idx where given."""
    on_m = "cu_seqlens_m" in op.varlen
    cu = (op.varlen["cu_seqlens_m"] if on_m else op.varlen["cu_seqlens_k"]).tolist()
    idx = op.varlen.get("A_idx")
    a, b, parts = op.a.double(), op.b.double(), []
    for e, (lo, hi) in enumerate(itertools.pairwise(cu)):
        read = torch.arange(lo, hi) if idx is None else idx[lo:hi].long()
        parts.append(a[read] @ b[e] if on_m else a[:, read] @ b[lo:hi])
    return torch.cat(parts) if on_m else torch.stack(parts)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_each_gemm_s_quack_operands_and_torch_twin_are_one_gemm_of_its_shape(sweep, routing):
    p = sweep.make_point(SHAPE, routing, TOKENS, 0, "cpu", torch.float32)
    r, d, f, e = TOKENS * SHAPE.k, SHAPE.d, SHAPE.f, SHAPE.e
    shapes = {"fc1": (r, 2 * f), "fc2": (r, d), "grad_h": (r, f), "grad_W2": (e, d, f),
              "grad_xg": (r, d), "grad_W1": (e, d, 2 * f)}  # fmt: skip
    assert p.cu.tolist()[0] == 0 and p.cu.tolist()[-1] == r and sum(p.rows_per_expert) == r
    assert p.cu.dtype == p.a_idx.dtype == p.offs.dtype == torch.int32
    for gemm in sweep.GEMMS:
        op = sweep.operands(p, gemm)
        got = as_quack(op)
        assert got.shape == op.out.shape == shapes[gemm], gemm
        twin = sweep.run_twin(op).double()  # torch._grouped_mm, which runs on CPU too
        torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5, msg=gemm)
        if gemm in sweep.VARLEN_K:  # quack's layout rules: A m-major, B row-major [R, N]
            assert op.a.stride(-2) == 1 and op.b.stride(-1) == 1, gemm
        else:
            assert op.a.stride(-1) == 1 and op.out.stride(-1) == 1, gemm
        assert ("A_idx" in op.varlen) == (gemm in sweep.GATHERED)
    grad_w1 = sweep.operands(p, "grad_W1")
    assert grad_w1.out.mT.is_contiguous()  # the [E, 2F, D] buffer experts_quack allocates
    assert grad_w1.mnk == (d, 2 * f, r) and sweep.operands(p, "fc1").mnk == (r, 2 * f, d)


def test_rel_err_is_zero_when_equal_and_nan_where_an_element_was_left_unwritten(sweep):
    want = torch.randn(40, 3)
    assert sweep.rel_err(want.clone(), want) == 0.0
    got = want.clone()
    got[17, 1] = math.nan
    assert math.isnan(sweep.rel_err(got, want))
    assert sweep.rel_err(want * 1.01, want) == pytest.approx(0.01, rel=1e-4)


def test_output_tiles_count_each_expert_s_row_tiles_or_its_whole_output(sweep):
    c = sweep.Config.parse(SM90_DEFAULT)  # 128 x 192
    assert sweep.output_tiles("fc1", [0, 100, 300], 65536, 1536, c) == (0 + 1 + 3) * 8
    assert sweep.output_tiles("grad_W2", [0, 100, 300], 2048, 1536, c) == 3 * 16 * 8


def sweep_result(sweep, report) -> dict:
    """Every GEMM of one point timed: on fc1 a candidate beats the default (1.1 against 1.2
    ms), elsewhere the only timed candidate is slower; one candidate failed everywhere."""
    p = sweep.make_point(SHAPE, "balanced", TOKENS, 0, "cpu", torch.float32)
    default = sweep.Config.parse(SM90_DEFAULT)
    rows = []
    for gemm in sweep.GEMMS:
        fast = 1.1 if gemm == "fc1" else 1.3
        times = {name: np.full(3, ms) for name, ms in
                 (("torch", 1.0), ("default", 1.2), ("128x128-pp-2x1-static", fast))}  # fmt: skip
        errors = {"torch": 1e-3, "default": 0.0, "128x128-pp-2x1-static": 0.0}
        failed = {"256x128-coop-2x1-static": "DSLRuntimeError: no smem"}
        rows += report.rows_of(p, sweep.operands(p, gemm), times, errors, failed, default)
    return {"gpu": "H100", "sm_count": 132, "commit": "abc", "tokens": TOKENS, "samples": 3,
            "default": SM90_DEFAULT, "errors": [], "rows": rows}  # fmt: skip


def test_each_row_has_its_point_config_and_ratios_and_a_failure_its_reason(sweep, report):
    rows = [r for r in sweep_result(sweep, report)["rows"] if r["gemm"] == "fc1"]
    by = {r["config"]: r for r in rows}
    assert set(by) == {"torch", "default", "128x128-pp-2x1-static", "256x128-coop-2x1-static"}
    assert by["torch"]["tile_m"] is None and by["torch"]["tiles"] is None
    assert by["default"]["tile_n"] == 192 and by["default"]["over_torch"] == pytest.approx(1.2)
    fast = by["128x128-pp-2x1-static"]
    assert fast["over_default"] == pytest.approx(1.1 / 1.2) and fast["exact"]
    assert fast["M"] == TOKENS * SHAPE.k and fast["rows_per_expert"]["max"] >= 1
    broken = by["256x128-coop-2x1-static"]
    assert broken["ms"] is None and broken["failed"] == "DSLRuntimeError: no smem"


def test_the_markdown_reads_the_best_config_per_gemm_and_the_point_s_sums(sweep, report):
    md = report.to_markdown(sweep_result(sweep, report))
    assert "| fc1 | 1 | 1.200 | 0.917 (0.917) | 1.100 | 128x128-pp-2x1-static (1) |" in md
    assert "| grad_h | 1 | 1.200 | 1.000 (1.000) | 1.200 | default (1) |" in md  # none beat it
    # six GEMMs of 1 ms under torch; the best per GEMM is fc1's candidate, else the default
    assert f"| small | balanced | 6.000 | 1.200 | {(1.1 + 5 * 1.2) / 6:.3f} |" in md
    assert md.count("DSLRuntimeError: no smem") == len(sweep.GEMMS)


@pytest.fixture(scope="module")
def fit():
    path = ROOT / "benchmarks" / "fit_moe_gemm_rule.py"
    spec = importlib.util.spec_from_file_location("fit_moe_gemm_rule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_sweep(fit, times: dict) -> dict:
    """Rows as the sweep writes them: per (model, gemm, K), each config's time over the default,
    and the torch twin's (which the fit must not count as a config)."""
    rows = []
    for (model, gemm, k), (coop, torch_twin) in times.items():
        for config, over in ((SM90_DEFAULT, 1.0), (fit.COOPERATIVE, coop), ("torch", torch_twin)):
            rows.append({"model": model, "routing": "balanced", "gemm": gemm, "K": k,
                         "config": config, "over_default": over})  # fmt: skip
    rows.append({"model": "a", "routing": "balanced", "gemm": "grad_W1", "K": 64,
                 "config": fit.COOPERATIVE, "over_default": 0.5})  # fmt: skip
    return {"default": SM90_DEFAULT, "rows": rows, "gpu": "GPU", "commit": "c", "command": "x"}


def test_the_fit_learns_the_depth_bound_out_of_sample_and_ignores_the_torch_twin(fit):
    # cooperative wins from K = 2048, loses at 512; torch is faster than both everywhere
    times = {
        (model, gemm, k): ((0.9, 0.5) if k >= 2048 else (1.1, 0.5))
        for model in ("a", "b", "c")
        for gemm, k in (("fc1", 2048), ("fc2", 512), ("grad_xg", 4096))
    }
    result = fit.evaluate(synthetic_sweep(fit, times))
    assert result["bound_fitted_on_all"] == (512 + 2048) / 2
    rows = result["leave_one_model_out"]["rows"]
    assert len(rows) == 9  # the varlen_k grad_W1 row is no row GEMM
    assert {r["pick"] for r in rows if r["K"] == 512} == {"default"}
    assert {r["pick"] for r in rows if r["K"] >= 2048} == {fit.COOPERATIVE}
    assert result["leave_one_model_out"]["summary"]["max_over_best"] == 1.0
    md = fit.to_markdown({"command": "python x"} | result)
    assert "| a | balanced | fc2 | 512 | 1280 | default | 1.000 | 1.000 |" in md
