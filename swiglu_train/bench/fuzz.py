"""A random-shape fuzz of every ParMLP impl against the float64 eager MLP.

A case is one ParMLP call drawn at random: impl (``auto`` and the quack impls included where
they run), dtype, bias, M (0 to 20000 on a GPU: odd values and primes among them), D, F and O
(multiples of 8 and 16, and not), rank-3, strided and transposed inputs, grad or no-grad, x
with or without a grad, ``inplace`` on or off, save_factors' pack chunk. Each is checked
against :func:`swiglu_train.ops.reference.mlp` in float64 on the same device (y, and in grad
mode the grads of x and of every parameter) within a tolerance per dtype, relative to each
value's norm or, where its sums cancel, to the rounding noise they carry; an impl
whose kernels cannot take the case (quack: fp32, or a size that is no multiple of 8) must
refuse it with its own error, and ``auto`` must not pick one for it; and where an impl saves
what it claims against ``normal`` (drop_h one [M, F] h less, save_factors the same), the bytes
saved for backward are compared on the same input (``memory.SavedTensorCounter``).

An output over tolerance is checked against torch's own eager MLP in the same dtype on the same
values: where that is as far off (within ``PLATFORM_SLACK``), the case is ``platform``, the
GEMM library's error and not the impl's, counted and listed apart from failures. The H200 fuzz
found one (benchmarks/results/cublas_fp16_k_tail_h200.txt).

Cases come from one seed, and each carries its own: a failing case replays alone from its JSON
(``scripts/fuzz_gpu.py --repro``). ``scripts/fuzz_gpu.py`` runs a thousand on the GPU, in
worker processes (:mod:`swiglu_train.bench.fuzz_pool`); the test suite runs a fixed-seed few on
the CPU, in the Triton interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from swiglu_train.layers import ParMLP, auto
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.layers.registry import AUTO, MLP_IMPLS, QUACK_IMPLS
from swiglu_train.memory import SavedTensorCounter
from swiglu_train.ops import reference
from swiglu_train.ops.quack_mlp import ALIGN, QUACK_DTYPES, quack_unavailable_reason

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
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
INPUT_KINDS = ("contiguous", "strided", "transposed", "batch_major")


@dataclass(frozen=True)
class Sizes:
    """Where cases are drawn from: M among ``special_m`` or log-uniform up to ``max_m``; D, F
    and O from ``dims`` (half the cases from its multiples of 8 alone), keeping
    M * max(D, F, O) within ``budget`` so that each case stays small."""

    special_m: tuple[int, ...]
    max_m: int
    dims: tuple[int, ...]
    budget: int


GPU_SIZES = Sizes(  # special M: edges, powers of two and their neighbours, primes
    special_m=(0, 1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 61, 64, 97, 127, 128, 129, 251, 509,
               1021, 2039, 4093, 8191, 16381, 19997, 20000),
    max_m=20000,
    dims=(1, 3, 7, 8, 12, 16, 20, 24, 33, 40, 48, 64, 96, 100, 128, 129, 200, 256, 264, 384,
          520, 1000, 1024),
    budget=1 << 21,
)  # fmt: skip
CPU_SIZES = Sizes(  # the Triton interpreter runs kernels at Python speed
    special_m=(0, 1, 2, 3, 5, 7, 13, 16, 17, 31),
    max_m=40,
    dims=(1, 3, 7, 8, 12, 16, 20, 24, 33),
    budget=1 << 10,
)


@dataclass(frozen=True)
class Case:
    impl: str
    dtype: str  # a key of DTYPES
    bias: bool
    lead: tuple[int, ...]  # x's leading dims: (M,) or (B, S) with B * S = M
    d: int
    f: int
    o: int
    grad: bool  # autograd records the call (else: torch.no_grad, the inference path)
    x_grad: bool  # x requires grad too (grad mode only)
    inplace: bool
    input_kind: str  # one of INPUT_KINDS
    chunk: int | None  # save_factors' pack chunk (None: its default)
    seed: int

    @property
    def m(self) -> int:
        return math.prod(self.lead)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        raw = json.loads(text)
        return cls(**{**raw, "lead": tuple(raw["lead"])})


@dataclass
class Outcome:
    case: Case
    status: str  # "passed", "refused" (as expected), "platform" (see run_case) or "failed"
    problems: list[str] = field(default_factory=list)
    resolved_impl: str | None = None  # what ParMLP runs (auto's pick)
    seconds: float = 0.0


def available_impls(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The impls to fuzz here, and why the others are left out."""
    reason = quack_unavailable_reason() if device.type == "cuda" else "not on a CUDA GPU"
    skipped = {name: reason for name in sorted(QUACK_IMPLS)} if reason else {}
    return [n for n in (*MLP_IMPLS, AUTO) if n not in skipped], skipped


def auto_table_points(device: torch.device, limit: int = 1 << 25) -> list[tuple[int, int, int]]:
    """(M, D, F) of the points of this GPU's crossover table with M * max(D, F) <= ``limit``:
    where ``auto`` picks from measurements (quack's impls among them), not the fallback."""
    if device.type != "cuda":
        return []
    table = auto.packaged_table(auto.gpu_family(auto.target_device_name(device)))
    points = [] if table is None else [p.dims for p in table.points]
    return sorted(p for p in points if p[0] * max(p[1:]) <= limit)


def draw_cases(
    seed: int,
    count: int,
    impls: list[str],
    sizes: Sizes,
    table_points: list[tuple[int, int, int]] = (),
    table_share: float = 0.03,
) -> Iterator[Case]:
    """``count`` cases from ``seed``, each with its own seed; ``table_share`` of them ``auto``
    at one of ``table_points`` (when any), D and F as measured and O = D or D + 4 (which
    quack's kernels cannot take)."""
    rng = random.Random(seed)
    for _ in range(count):
        case = draw_case(rng, impls, sizes)
        if table_points and AUTO in impls and rng.random() < table_share:
            m, d, f = rng.choice(table_points)
            lead = (m,) if rng.random() < 0.5 else _split(rng, m)
            o = d + rng.choice((0, 4))
            case = dataclasses.replace(case, impl=AUTO, lead=lead, d=d, f=f, o=o, chunk=None)
        yield case


def draw_case(rng: random.Random, impls: list[str], sizes: Sizes) -> Case:
    impl = rng.choice(impls)
    m = rng.choice(sizes.special_m) if rng.random() < 0.35 else _log_uniform(rng, sizes.max_m)
    fits = [n for n in sizes.dims if n * max(m, 1) <= sizes.budget] or [min(sizes.dims)]
    aligned = [n for n in fits if n % ALIGN == 0]
    pool = aligned if aligned and rng.random() < 0.5 else fits
    d, f, o = (rng.choice(pool) for _ in range(3))
    lead = (m,)
    if rng.random() < 0.4:
        lead = _split(rng, m)
    grad = rng.random() < 0.7
    chunk = None  # save_factors' default: the largest power of two up to 128 dividing F
    if impl == "save_factors" and rng.random() < 0.5:
        chunk = rng.choice(_chunks(f))
    return Case(
        impl=impl,
        dtype=rng.choice(list(DTYPES)),
        bias=rng.random() < 0.5,
        lead=lead,
        d=d,
        f=f,
        o=o,
        grad=grad,
        x_grad=grad and rng.random() < 0.85,
        inplace=rng.random() < 0.6,
        input_kind=rng.choice(INPUT_KINDS),
        chunk=chunk,
        seed=rng.randrange(1 << 31),
    )


def _chunks(f: int) -> list[int]:
    """Pack chunks to try for F: the powers of two dividing it, F itself and its largest odd
    divisor; not every divisor, as each chunk compiles its own kernels on a GPU."""
    odd = f // (f & -f)
    return sorted({c for c in (1, 2, 4, 8, 16, 32, 64, 128) if f % c == 0} | {f, odd})


def _log_uniform(rng: random.Random, top: int) -> int:
    return min(top, int(math.exp(rng.uniform(0.0, math.log(top + 1)))))


def _split(rng: random.Random, m: int) -> tuple[int, int]:
    """(B, S) with B * S = m: any divisor (1 and m included), or a zero batch for m = 0."""
    if m == 0:
        return rng.choice(((0, rng.randint(1, 7)), (rng.randint(1, 7), 0)))
    b = rng.choice([b for b in range(1, min(m, 64) + 1) if m % b == 0])
    return (b, m // b)


def make_input(case: Case, device: torch.device) -> torch.Tensor:
    """x of shape (*lead, D), laid out as ``case.input_kind`` says."""
    dtype, shape = DTYPES[case.dtype], (*case.lead, case.d)
    if case.input_kind == "strided":  # every other column of a wider tensor
        return torch.randn(*case.lead, 2 * case.d, device=device, dtype=dtype)[..., ::2]
    if case.input_kind == "transposed":  # the last two dims swapped in memory
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device, dtype=dtype)
        return base.transpose(-1, -2)
    if case.input_kind == "batch_major" and len(case.lead) == 2:  # [S, B, D] seen as [B, S, D]
        return torch.randn(shape[1], shape[0], shape[2], device=device, dtype=dtype).transpose(0, 1)
    return torch.randn(*shape, device=device, dtype=dtype)


def build(case: Case, device: torch.device) -> ParMLP:
    hint = {"tokens_hint": case.m or None} if case.impl == AUTO else {}
    return ParMLP(
        case.d, case.f, case.o, bias=case.bias, impl=case.impl, inplace=case.inplace,
        chunk=case.chunk, device=device, dtype=DTYPES[case.dtype], **hint,
    )  # fmt: skip


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


def reference_outputs(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor | None) -> dict:
    """y (and with ``grad_y`` the grads of x and every parameter) of the eager MLP in float64
    on the same values, each with the norm its error is measured against (:func:`_scale`); a
    packed fc1 is unpacked for it and its grads packed back."""
    layout, grad = mlp.fc1_layout, grad_y is not None
    params = {}
    for name, p in mlp.named_parameters():
        value = p.detach().double()
        if name.startswith("fc1."):
            value = relayout(value, layout, CANONICAL)
        params[name] = value.requires_grad_(grad)
    w1, b1, w2, b2 = (params.get(n) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    x64 = x.detach().double().reshape(-1, x.shape[-1]).requires_grad_(grad)
    with torch.enable_grad():
        preact = F.linear(x64, w1, b1)
        if grad:
            preact.retain_grad()
        h = reference.swiglu(preact)
        y = F.linear(h, w2, b2)
    h = h.detach()
    y_scale = _scale(h, w2.detach().t(), None if b2 is None else b2.detach())
    out = {"y": (y.detach().view(*x.shape[:-1], w2.shape[0]), y_scale)}
    if not grad:
        return out
    gy = grad_y.double().reshape(-1, grad_y.shape[-1])
    y.backward(gy)
    gp = preact.grad
    scales = {
        "x": _scale(gp, w1.detach()),
        "fc1.weight": _scale(gp.t(), x64.detach()),
        "fc1.bias": gp.norm().item(),
        "fc2.weight": _scale(gy.t(), h),
        "fc2.bias": gy.norm().item(),
    }
    out["x"] = (x64.grad.view(x.shape), scales["x"])
    for name, p in params.items():
        value = relayout(p.grad, CANONICAL, layout) if name.startswith("fc1.") else p.grad
        out[name] = (value, scales[name])
    return out


def _scale(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> float:
    """The norm of the root-sum-square of the terms of ``a @ b (+ bias)``: how large the
    rounding noise its inputs carry makes its error, where its sums cancel (an output of a
    few elements summing a few terms, say) and the norm of the result would not say."""
    terms = (a.square().sum(0) * b.square().sum(1)).sum()
    if bias is not None:
        terms = terms + a.shape[0] * bias.square().sum()
    return terms.sqrt().item()


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


def rel_err(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, scale), in float64 (inf for a non-finite
    actual): norm-relative, unless the expected sums cancel below the noise ``scale`` says."""
    actual = actual.double()
    if not torch.isfinite(actual).all():
        return math.inf
    return ((actual - expected).norm() / max(expected.norm().item(), scale, 1e-30)).item()


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


def eager_errors(mlp: ParMLP, x: torch.Tensor, grad_y: torch.Tensor | None, expected: dict):
    """The relative errors of torch's own eager MLP (two F.linear around F.silu(gate) * up) in
    the case's dtype on the same device and values: what the platform's GEMMs achieve."""
    layout, grad = mlp.fc1_layout, grad_y is not None
    params = {}
    for name, p in mlp.named_parameters():
        value = p.detach()
        if name.startswith("fc1."):
            value = relayout(value, layout, CANONICAL)
        params[name] = value.clone().requires_grad_(grad)
    w1, b1, w2, b2 = (params.get(n) for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    x2d = x.detach().reshape(-1, x.shape[-1]).clone().requires_grad_(grad)
    with torch.enable_grad():
        y = reference.mlp(x2d, w1, b1, w2, b2)
    got = {"y": y.detach().view(expected["y"][0].shape)}
    if grad:
        y.backward(grad_y.reshape(-1, grad_y.shape[-1]))
        got["x"] = x2d.grad.view(x.shape)
        for name, p in params.items():
            got[name] = relayout(p.grad, CANONICAL, layout) if name.startswith("fc1.") else p.grad
    return {name: rel_err(got[name], want, scale) for name, (want, scale) in expected.items()}


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
