"""The random-shape fuzz of every impl: a fixed-seed CPU subset (Triton interpreter) passes, its
checker fails what it should, and benchmarks/fuzz_gpu.py writes its summary."""

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import pickle
import signal
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA

from swiglu_train.bench.fuzz import cases as fuzz_cases
from swiglu_train.bench.fuzz import pool as fuzz_pool
from swiglu_train.bench.fuzz import reference as fuzz_reference
from swiglu_train.bench.fuzz import run as fuzz
from swiglu_train.layers import registry
from swiglu_train.ops import normal_mlp
from swiglu_train.ops.quack_mlp import quack_available

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def load_script():
    spec = importlib.util.spec_from_file_location("fuzz_gpu", ROOT / "benchmarks" / "fuzz_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_fixed_seed_cpu_fuzz_passes_and_covers_the_space():
    impls, skipped = fuzz_cases.available_impls(CPU)
    assert set(skipped) == registry.QUACK_IMPLS  # no quack on a CPU
    cases = list(fuzz_cases.draw_cases(seed=0, count=150, impls=impls, sizes=fuzz_cases.CPU_SIZES))
    outcomes, stopped = fuzz.run_cases(cases, CPU)
    failed = [f"{o.problems}: {o.case.to_json()}" for o in outcomes if o.status == "failed"]
    assert stopped is None and not failed, "\n".join(failed)
    assert {o.status for o in outcomes} == {"passed"}  # nothing on a CPU is due to be refused
    assert {c.impl for c in cases} == {*registry.MLP_IMPLS, "auto"} - registry.QUACK_IMPLS
    assert {c.dtype for c in cases} == set(fuzz_cases.DTYPES)
    assert {c.input_kind for c in cases} == set(fuzz_cases.INPUT_KINDS)
    assert (
        {c.grad for c in cases}
        == {c.bias for c in cases}
        == {c.inplace for c in cases}
        == {
            True,
            False,
        }
    )
    assert any(c.m == 0 for c in cases) and any(len(c.lead) == 2 for c in cases)
    assert any(c.chunk not in (None, c.f) for c in cases if c.impl == "save_factors")
    assert any(n % 8 for c in cases for n in (c.d, c.f, c.o))
    assert any(c.grad and not c.x_grad for c in cases)


def test_some_auto_cases_are_drawn_at_the_auto_model_s_points():
    """There auto picks from its model (quack's impls among them), not its fallback; O is
    D or D + 4, which quack's kernels cannot take."""
    points = [(2048, 2048, 5632), (4096, 2048, 5632)]
    cases = list(
        fuzz_cases.draw_cases(0, 200, ["normal", "auto"], fuzz_cases.GPU_SIZES, points, 0.25)
    )
    at_points = [c for c in cases if (c.m, c.d, c.f) in points]
    assert 20 < len(at_points) < 80 and all(c.impl == "auto" for c in at_points)
    assert {c.o - c.d for c in at_points} == {0, 4}
    assert fuzz_cases.auto_table_points(CPU) == []  # auto falls back off CUDA: no points to aim at


def drop_h_case(**changes) -> fuzz_cases.Case:
    case = fuzz_cases.Case(
        impl="drop_h", dtype="fp32", bias=True, lead=(3, 7), d=12, f=20, o=8, grad=True,
        x_grad=True, inplace=True, input_kind="strided", chunk=None, seed=5,
    )  # fmt: skip
    return dataclasses.replace(case, **changes)


def test_a_case_replays_from_its_json():
    case = drop_h_case(lead=(0, 3), chunk=4, impl="save_factors")
    assert fuzz_cases.Case.from_json(case.to_json()) == case
    assert fuzz.run_case(case, CPU).status == "passed"


class ScaleGrad(torch.autograd.Function):
    """Identity forward; its backward is off by 5 %."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 1.05 * grad


@pytest.mark.parametrize("wrong", ["y", "x"])
def test_the_checker_fails_a_wrong_value_or_grad(monkeypatch, wrong):
    from swiglu_train.layers.par_mlp import ParMLP

    apply = ParMLP._apply_impl

    def off(self, x, *params):
        if wrong == "x":
            return apply(self, ScaleGrad.apply(x), *params)
        y = apply(self, x, *params)
        return y + 1e-3 * y.detach()  # the grads stay right

    monkeypatch.setattr(ParMLP, "_apply_impl", off)
    outcome = fuzz.run_case(drop_h_case(), CPU)
    assert outcome.status == "failed"
    assert [p.split(":")[0] for p in outcome.problems] == [wrong]
    assert "relative error" in outcome.problems[0]


def test_the_checker_fails_a_drop_h_that_saves_h(monkeypatch):
    """drop_h run as normal computes the same values, but saves [M, F] more than it claims."""
    monkeypatch.setitem(registry._IMPLS, "drop_h", normal_mlp)
    outcome = fuzz.run_case(drop_h_case(), CPU)
    m, item = 21, 4
    saved = (3 * 7 * 24 + m * 40 + m * 20) * item  # x's strided storage, preact, h
    assert outcome.status == "failed"
    assert outcome.problems == [
        f"saved {saved} bytes for backward, normal {saved}: expected a difference of "
        f"{-m * 20 * item} (-1 x [M, F] = {m * 20 * item} bytes)"
    ]


def test_quack_refusals_are_expected_only_where_their_kernels_cannot_run():
    quack = drop_h_case(impl="drop_h_quack", dtype="bf16", d=16, f=32, o=8)
    assert fuzz.expected_refusal(quack, "drop_h_quack") is None
    assert fuzz.expected_refusal(dataclasses.replace(quack, grad=False), "drop_h_quack") is None
    assert fuzz.expected_refusal(dataclasses.replace(quack, dtype="fp32"), "drop_h_quack") == (
        TypeError,
        "needs bf16 or fp16 tensors",
    )
    odd = dataclasses.replace(quack, o=12)
    assert fuzz.expected_refusal(odd, "save_factors_quack") == (
        ValueError,
        "needs sizes that are multiples of 8",
    )
    assert fuzz.expected_refusal(odd, "drop_h") is None
    assert fuzz.expected_refusal(dataclasses.replace(odd, impl="auto"), "drop_h_quack") is None


def test_the_script_writes_a_summary_and_replays_a_case(tmp_path, capsys):
    script = load_script()
    out = tmp_path / "fuzz.json"
    assert script.main(["--device", "cpu", "--cases", "8", "--seed", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cases"] == result["cases_requested"] == 8 and result["complete"]
    assert result["counts"] == {"passed": 8} and result["failures"] == []
    assert sum(sum(c.values()) for c in result["per_impl"].values()) == 8
    assert result["device"] == "cpu" and result["gpu"] is None
    assert result["command"].startswith("python3 benchmarks/fuzz_gpu.py --device cpu --cases 8")
    assert set(result["skipped_impls"]) == registry.QUACK_IMPLS
    capsys.readouterr()
    assert script.main(["--device", "cpu", "--repro", drop_h_case().to_json()]) == 0
    assert capsys.readouterr().out.startswith("passed (drop_h, ")


def run_script(monkeypatch, tmp_path, *args, wrap_pool_callback=None) -> tuple[dict, list]:
    """benchmarks/fuzz_gpu.py's summary for ``args``, and the outcomes its runner returned (both
    runners wrapped to record them; ``wrap_pool_callback`` wraps the pool's on_outcome)."""
    returned = []

    def recording(run, wrap_callback=None):
        def wrapper(*a, **kw):
            if wrap_callback:  # the pool's on_outcome: its fourth argument
                a = (*a[:3], wrap_callback(a[3]), *a[4:])
            outcomes, stopped = run(*a, **kw)
            returned.extend(outcomes)
            return outcomes, stopped

        return wrapper

    out = tmp_path / "fuzz.json"
    with monkeypatch.context() as patch:
        patch.setattr(fuzz, "run_cases", recording(fuzz.run_cases))
        pool = recording(fuzz_pool.run_cases_pool, wrap_pool_callback)
        patch.setattr(fuzz_pool, "run_cases_pool", pool)
        code = load_script().main(["--device", "cpu", "--seed", "3", "--json", str(out), *args])
    assert code == 0
    return json.loads(out.read_text()), returned


def test_workers_run_the_cases_one_process_runs_and_list_them_in_case_order(monkeypatch, tmp_path):
    """--workers 2 draws the same cases from the same seed, with the same outcomes, in order."""
    one, in_process = run_script(monkeypatch, tmp_path, "--cases", "10")
    two, pooled = run_script(monkeypatch, tmp_path, "--cases", "10", "--workers", "2")
    assert (
        [o.case for o in pooled]
        == [o.case for o in in_process]
        == list(
            fuzz_cases.draw_cases(3, 10, fuzz_cases.available_impls(CPU)[0], fuzz_cases.CPU_SIZES)
        )
    )
    assert [(o.status, o.resolved_impl, o.problems) for o in pooled] == [
        (o.status, o.resolved_impl, o.problems) for o in in_process
    ]
    assert (one["workers"], two["workers"]) == (1, 2) and two["complete"] and not two["stopped"]
    for key in ("cases", "counts", "per_impl", "per_dtype", "auto_picks", "failures", "max_m"):
        assert one[key] == two[key], key
    assert pickle.loads(pickle.dumps(pooled[0])) == pooled[0]  # what a worker sends back


def test_no_case_starts_after_max_seconds_in_the_pool(monkeypatch, tmp_path):
    """Spawning the workers alone takes longer than 0.01 s: no case runs, and the summary says
    so (the workers' deadline is the parent's)."""
    result, ran = run_script(
        monkeypatch, tmp_path, "--cases", "6", "--workers", "2", "--max-seconds", "0.01"
    )
    assert ran == [] and result["cases"] == 0 and result["cases_requested"] == 6
    assert not result["complete"]
    assert result["stopped"] == "stopped after 0.01 s (--max-seconds); 6 of 6 cases not run"


def test_a_worker_that_dies_stops_the_run_and_names_the_cases_in_flight(monkeypatch, tmp_path):
    """A worker killed after the first outcome: the run stops with BrokenProcessPool, naming the
    cases in flight, and what ran before is still summarized and written."""

    def kill_a_worker(on_outcome):
        def first_kills(outcome):
            on_outcome(outcome)
            workers = multiprocessing.active_children()
            if workers and not killed:
                os.kill(workers[0].pid, signal.SIGKILL)
                killed.append(workers[0].pid)

        return first_kills

    killed = []
    result, ran = run_script(
        monkeypatch, tmp_path, "--cases", "40", "--workers", "2", wrap_pool_callback=kill_a_worker
    )
    assert killed and 1 <= len(ran) < 40 and result["cases"] == len(ran)
    assert not result["complete"]
    stopped = result["stopped"]
    assert stopped.startswith("a worker process died (BrokenProcessPool: ")
    assert stopped.endswith(f"; {40 - len(ran)} of 40 cases not run")
    in_flight = stopped.split("in flight: ")[1].split("; ")[:-1]  # "none" if both had ended
    cases = list(
        fuzz_cases.draw_cases(3, 40, fuzz_cases.available_impls(CPU)[0], fuzz_cases.CPU_SIZES)
    )
    named = {int(item.split()[1]): item for item in in_flight if item != "none"}
    assert named or in_flight == ["none"]
    assert all(item == f"case {n} {cases[n].to_json()}" for n, item in named.items())
    assert [o.case for o in ran] == [c for c in cases if c in {o.case for o in ran}]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_a_short_gpu_fuzz_passes():
    device = torch.device("cuda")
    impls, _ = fuzz_cases.available_impls(device)
    cases = fuzz_cases.draw_cases(seed=1, count=60, impls=impls, sizes=fuzz_cases.GPU_SIZES)
    outcomes, stopped = fuzz.run_cases(cases, device)
    failed = [f"{o.problems}: {o.case.to_json()}" for o in outcomes if o.status == "failed"]
    assert stopped is None and not failed, "\n".join(failed)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and quack_available()), reason="needs quack on sm_90+")
@pytest.mark.parametrize("impl", sorted(registry.QUACK_IMPLS))
def test_quack_impls_refuse_with_their_own_error(impl):
    device = torch.device("cuda")
    runs = drop_h_case(impl=impl, dtype="bf16", d=16, f=32, o=8, input_kind="contiguous")
    for case, status in [
        (runs, "passed"),
        (dataclasses.replace(runs, dtype="fp32"), "refused"),
        (dataclasses.replace(runs, d=12), "refused"),
        (dataclasses.replace(runs, o=20), "refused"),
        (dataclasses.replace(runs, o=20, grad=False, x_grad=False), "passed"),
    ]:
        outcome = fuzz.run_case(case, device)
        assert outcome.status == status, (case, outcome.problems)


def test_an_error_torch_s_own_eager_mlp_shares_is_the_platform_s(monkeypatch):
    """An output over tolerance is a failure unless torch's eager MLP in the same dtype is as
    far off on the same values (the H200's cuBLAS fp16 case): then it is counted apart."""
    from swiglu_train.layers.par_mlp import ParMLP

    apply = ParMLP._apply_impl
    monkeypatch.setattr(
        ParMLP, "_apply_impl", lambda self, x, *p: (y := apply(self, x, *p)) + 1e-3 * y.detach()
    )
    outcome = fuzz.run_case(drop_h_case(), CPU)  # torch's eager MLP is right here
    assert outcome.status == "failed"
    own = float(outcome.problems[0].split("relative error ")[1].split(" ")[0])
    eager = float(outcome.problems[0].split(": ")[-1].rstrip(")"))
    assert own > fuzz.TOLERANCE["fp32"] > eager

    real = fuzz.eager_errors
    outcomes = {}
    for factor in (0.9, 0.5):  # torch's eager MLP as far off (within 1.25x), or not
        monkeypatch.setattr(fuzz, "eager_errors", lambda *a, f=factor: {**real(*a), "y": f * own})
        outcomes[factor] = fuzz.run_case(drop_h_case(), CPU)
        assert "torch's eager MLP in fp32" in outcomes[factor].problems[0]
    assert [o.status for o in outcomes.values()] == ["platform", "failed"]
    summary = fuzz.summary(list(outcomes.values()), lambda case: "repro")
    assert summary["counts"] == {"platform": 1, "failed": 1}
    assert [e["problems"] for e in summary["platform_errors"]] == [outcomes[0.9].problems]
    assert [e["problems"] for e in summary["failures"]] == [outcomes[0.5].problems]


def test_eager_errors_are_within_tolerance_for_a_correct_case():
    case = drop_h_case()
    mlp = fuzz_cases.build(case, CPU)
    x = fuzz_cases.make_input(case, CPU)
    grad_y = torch.randn(*case.lead, case.o)
    expected = fuzz_reference.reference_outputs(mlp, x, grad_y)
    errors = fuzz_reference.eager_errors(mlp, x, grad_y, expected)
    assert set(errors) == set(expected)
    assert max(errors.values()) < fuzz.TOLERANCE[case.dtype]
