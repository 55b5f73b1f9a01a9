"""A random-shape fuzz of every ParMLP impl against the float64 eager MLP.

Each case (:mod:`swiglu_train.bench.fuzz.cases`) is checked against the eager MLP in float64
on the same device (:mod:`swiglu_train.bench.fuzz.reference`): y, and in grad mode the grads
of x and of every parameter, within a tolerance per dtype, relative to each value's norm or,
where its sums cancel, to the rounding noise they carry; an impl whose kernels cannot take
the case (quack: fp32, or a size that is no multiple of 8) must refuse it with its own error,
and ``auto`` must not pick one for it; and where an impl saves what it claims against
``normal`` (drop_h one [M, F] h less, save_factors the same), the bytes saved for backward are
compared on the same input (``memory.SavedTensorCounter``).

An output over tolerance is checked against torch's own eager MLP in the same dtype on the same
values: where that is as far off (within ``PLATFORM_SLACK``), the case is ``platform``, the
GEMM library's error and not the impl's, counted and listed apart from failures. The H200 fuzz
found one (benchmarks/results/gemm/cublas_fp16_k_tail_h200.txt).

A failing case replays alone from its JSON (``benchmarks/fuzz_gpu.py --repro``).
``benchmarks/fuzz_gpu.py`` runs a thousand on the GPU, in worker processes
(:mod:`swiglu_train.bench.fuzz.pool`); the test suite runs a fixed-seed few on the CPU, in the
Triton interpreter.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch

from swiglu_train.bench.fuzz.cases import DTYPES, Case, build, make_input
from swiglu_train.bench.fuzz.reference import eager_errors, reference_outputs, rel_err
from swiglu_train.layers import ParMLP
from swiglu_train.layers.registry import AUTO, QUACK_IMPLS
from swiglu_train.memory import SavedTensorCounter
from swiglu_train.ops.quack_mlp import ALIGN, QUACK_DTYPES

# Error allowed against float64, relative to the norm of the expected value or, where its sums
# cancel, of the rounding noise they carry (rel_err). 16-bit types: 8 unit roundoffs, for the
# roundings of the preactivation, h and each output (1500 random CPU cases of normal, drop_h
# and save_factors in the interpreter: worst bf16 error 1.6 %, 4 roundoffs; fp16 0.1 %, 2).
# fp32: its accumulation over K up to ~20000 (cuBLAS, Triton's IEEE dots); TF32 would fail it.
TOLERANCE = {"fp32": 5e-5, "fp16": 8 * 2.0**-11, "bf16": 8 * 2.0**-8}
# An impl's error over tolerance is the platform's when torch's eager MLP errs as much: within
# 1.25x covers the roundings an impl adds on top of the same GEMMs (one fewer or more rounding
# of h or the preactivation), not a wrong result.
PLATFORM_SLACK = 1.25
# Bytes an impl saves for backward beyond normal's, in units of one [M, F] activation: drop_h
# recomputes h, save_factors keeps its factors [M, 2F] and h as normal keeps preact and h.
SAVED_VS_NORMAL = {"drop_h": -1, "save_factors": 0, "drop_h_quack": -1, "save_factors_quack": 0}


@dataclass
class Outcome:
    case: Case
    status: str  # "passed", "refused" (as expected), "platform" (see run_case) or "failed"
    problems: list[str] = field(default_factory=list)
    resolved_impl: str | None = None  # what ParMLP runs (auto's pick)
    seconds: float = 0.0


def expected_refusal(case: Case, impl: str) -> tuple[type[Exception], str] | None:
    """The error an impl named for a case its kernels cannot take must raise; None: it must
    run. Only with a grad to compute (without, every impl takes the shared inference path),
    and never for ``auto``, which must not pick such an impl (a quack impl it picked runs
    fp32 through its portable twin)."""
    if impl not in QUACK_IMPLS or not case.grad or case.impl == AUTO:
        return None
    if DTYPES[case.dtype] not in QUACK_DTYPES:
        return TypeError, "needs bf16 or fp16 tensors"
    if any(n % ALIGN for n in (case.d, case.f, case.o)):
        return ValueError, f"needs sizes that are multiples of {ALIGN}"
    return None


def run_outputs(
    mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor | None, x_grad: bool
) -> tuple[dict, int | None]:
    """y and the grads, as the impl computes them, and the bytes it saved for backward."""
    mlp.zero_grad(set_to_none=True)
    if grad_y is None:
        with torch.no_grad():
            return {"y": mlp(x)}, None
    x = x.detach().requires_grad_(x_grad)
    with SavedTensorCounter(exclude=mlp.parameters()) as saved:
        y = mlp(x)
    y.backward(grad_y)
    out = {"y": y.detach(), **({"x": x.grad} if x_grad else {})}
    out.update({name: p.grad for name, p in mlp.named_parameters()})
    return out, saved.bytes


def compare(case: Case, actual: dict, expected: dict) -> tuple[list[str], dict[str, float]]:
    """Problems other than accuracy, and the relative error of each output over tolerance."""
    problems, misses = [], {}
    for name, (want, scale) in expected.items():
        if name == "x" and not case.x_grad:
            continue
        got = actual.get(name)
        if got is None:
            problems.append(f"{name}: no value (expected shape {tuple(want.shape)})")
        elif got.shape != want.shape or got.dtype != DTYPES[case.dtype]:
            problems.append(f"{name}: {tuple(got.shape)} {got.dtype}, expected "
                            f"{tuple(want.shape)} {DTYPES[case.dtype]}")  # fmt: skip
        elif (err := rel_err(got, want, scale)) > TOLERANCE[case.dtype]:
            misses[name] = err
    return problems, misses


def saved_bytes_problem(case: Case, mlp: ParMLP, x: torch.Tensor, saved: int) -> str | None:
    """Against normal on the same input and weights: drop_h must save exactly one [M, F] h
    less, save_factors exactly as much. quack's impls copy a non-contiguous x before saving
    it, so they are compared on contiguous inputs only."""
    units = SAVED_VS_NORMAL.get(mlp.impl)
    if units is None or (mlp.impl in QUACK_IMPLS and not x.is_contiguous()):
        return None
    normal = ParMLP(case.d, case.f, case.o, bias=case.bias, impl="normal",
                    device=x.device, dtype=x.dtype)  # fmt: skip
    normal.load_state_dict(mlp.state_dict())
    with SavedTensorCounter(exclude=normal.parameters()) as counter:
        normal(x.detach().requires_grad_(case.x_grad))
    normal_saved = counter.bytes
    h_bytes = case.m * case.f * x.element_size()
    if saved - normal_saved != units * h_bytes:
        return (
            f"saved {saved} bytes for backward, normal {normal_saved}: expected a difference "
            f"of {units * h_bytes} ({units:+d} x [M, F] = {h_bytes} bytes)"
        )
    return None


def run_case(case: Case, device: torch.device | str) -> Outcome:
    """Build, run and check one case; every exception that is not the expected refusal is a
    failure of the case, named in its problems."""
    device, start = torch.device(device), time.perf_counter()
    torch.manual_seed(case.seed)
    outcome = Outcome(case, "passed")
    try:
        mlp = build(case, device)
        outcome.resolved_impl = mlp.impl
        x = make_input(case, device)
        grad_y = (
            torch.randn(*case.lead, case.o, device=device, dtype=x.dtype) if case.grad else None
        )
        expected = reference_outputs(mlp, x, grad_y)
        refusal = expected_refusal(case, mlp.impl)
        try:
            actual, saved = run_outputs(mlp, x, grad_y, case.x_grad)
        except Exception as e:
            if refusal and isinstance(e, refusal[0]) and refusal[1] in str(e):
                outcome.status = "refused"
                return outcome
            raise
        if refusal is not None:
            outcome.problems.append(f"ran where {refusal[0].__name__} '{refusal[1]}' was due")
        problems, misses = compare(case, actual, expected)
        outcome.problems += problems
        if saved is not None and (problem := saved_bytes_problem(case, mlp, x, saved)):
            outcome.problems.append(problem)
        if misses:
            eager = eager_errors(mlp, x, grad_y, expected)
            platform = not outcome.problems and all(
                err <= PLATFORM_SLACK * eager[name] for name, err in misses.items()
            )
            outcome.problems += [
                f"{name}: relative error {err:.3g} > {TOLERANCE[case.dtype]:g} "
                f"(torch's eager MLP in {case.dtype}: {eager[name]:.3g})"
                for name, err in misses.items()
            ]
            if platform:
                outcome.status = "platform"
                return outcome
    except Exception as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        picked = f" (auto picked {outcome.resolved_impl})" if case.impl == AUTO else ""
        outcome.problems.append(f"{type(e).__name__}{picked}: {text}")
    finally:
        outcome.seconds = time.perf_counter() - start
    if outcome.problems and outcome.status == "passed":
        outcome.status = "failed"
    return outcome


def run_cases(
    cases: Iterable[Case],
    device: torch.device | str,
    on_outcome: Callable[[Outcome], None] = lambda outcome: None,
    max_seconds: float | None = None,
) -> tuple[list[Outcome], str | None]:
    """Run cases in order; returns the outcomes and why the run stopped early (None: it ran
    them all). A CUDA error that leaves the context unusable stops it, as does
    ``max_seconds`` (checked between cases)."""
    outcomes, start = [], time.perf_counter()
    for case in cases:
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            return outcomes, f"stopped after {max_seconds:g} s (--max-seconds)"
        outcome = run_case(case, device)
        outcomes.append(outcome)
        on_outcome(outcome)
        if failure := context_failure(outcome, device):
            return outcomes, f"the CUDA context failed after this case: {failure}"
    return outcomes, None


def context_failure(outcome: Outcome, device: torch.device | str) -> str | None:
    """After a failed case on CUDA, the error that left the context unusable, if one did: no
    later case in this process could run."""
    if outcome.status != "failed" or torch.device(device).type != "cuda":
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        return str(e)
    return None


def summary(outcomes: list[Outcome], repro: Callable[[Case], str]) -> dict:
    """Counts per status, impl and dtype, auto's picks, each failure and platform error with its
    reproduction, and the slowest cases."""
    per_impl: dict[str, Counter] = {}
    per_dtype: dict[str, Counter] = {}
    for o in outcomes:
        per_impl.setdefault(o.case.impl, Counter())[o.status] += 1
        per_dtype.setdefault(o.case.dtype, Counter())[o.status] += 1
    slowest = sorted(outcomes, key=lambda o: o.seconds, reverse=True)[:10]
    return {
        "cases": len(outcomes),
        "counts": dict(Counter(o.status for o in outcomes)),
        "per_impl": {k: dict(v) for k, v in sorted(per_impl.items())},
        "per_dtype": {k: dict(v) for k, v in sorted(per_dtype.items())},
        "auto_picks": dict(Counter(o.resolved_impl for o in outcomes if o.case.impl == AUTO)),
        "grad_cases": sum(o.case.grad for o in outcomes),
        "max_m": max((o.case.m for o in outcomes), default=0),
        **{
            key: [
                {
                    "case": asdict(o.case),
                    "resolved_impl": o.resolved_impl,
                    "problems": o.problems,
                    "repro": repro(o.case),
                }
                for o in outcomes
                if o.status == status
            ]
            for key, status in (("failures", "failed"), ("platform_errors", "platform"))
        },
        "slowest": [{"seconds": round(o.seconds, 3), "case": o.case.to_json()} for o in slowest],
    }
