"""The cases of the random-shape fuzz (:mod:`swiglu_train.bench.fuzz.run`): drawing them, and
building the ParMLP and input each names.

A case is one ParMLP call drawn at random: impl (``auto`` and the quack impls included where
they run), dtype, bias, M (0 to 20000 on a GPU: odd values and primes among them), D, F and O
(multiples of 8 and 16, and not), rank-3, strided and transposed inputs, grad or no-grad, x
with or without a grad, ``inplace`` on or off, save_factors' pack chunk. Cases come from one
seed, and each carries its own, so that a failing case replays alone from its JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from swiglu_train.layers import ParMLP, auto
from swiglu_train.layers.registry import AUTO, MLP_IMPLS, QUACK_IMPLS
from swiglu_train.ops.quack_mlp import ALIGN, quack_unavailable_reason

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
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


def available_impls(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The impls to fuzz here, and why the others are left out."""
    reason = quack_unavailable_reason() if device.type == "cuda" else "not on a CUDA GPU"
    skipped = {name: reason for name in sorted(QUACK_IMPLS)} if reason else {}
    return [n for n in (*MLP_IMPLS, AUTO) if n not in skipped], skipped


def auto_table_points(device: torch.device, limit: int = 1 << 25) -> list[tuple[int, int, int]]:
    """(M, D, F) of the points this GPU's auto model was fitted at with M * max(D, F) <=
    ``limit``: where ``auto`` picks from the model (quack's impls among them), not the
    fallback."""
    if device.type != "cuda":
        return []
    model = auto.find_model(auto.gpu_family(auto.target_device_name(device)))
    points = [] if model is None else list(model.points)
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
