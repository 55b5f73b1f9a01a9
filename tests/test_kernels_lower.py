"""Every launch of the Triton kernels lowers for the GPU (sm_90), checked on a CPU machine.

Under TRITON_INTERPRET=1 the kernels run in Triton's interpreter, which executes their Python
bodies: it takes code the GPU compiler's front end rejects (a tuple of two dtypes in one
assignment ran in every CPU test and failed to compile on CUDA, a1306b4) and drops launch
keywords the GPU refuses. So the launches the interpreter runs are recorded here, each turned
into the compilation the GPU would ask for (Triton's own argument specialization against a
Hopper target, the interpreter-only constexprs at their GPU values, the gated GEMM through TMA
descriptors as well), and lowered to TTIR by Triton's front end in a child process without the
interpreter, where ``@triton.jit`` gives the compiler's JITFunctions.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import pkgutil
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import (  # noqa: E402
    JITFunction,
    KernelInterface,
    create_function_from_signature,
)
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import swiglu_train.kernels  # noqa: E402
from swiglu_train.kernels import (  # noqa: E402
    experts_swiglu,
    experts_wgrad,
    float8_cast,
    fused_mlp,
    gated_gemm,
    swiglu,
    swiglu_float8,
    swiglu_fp8,
    swiglu_fp8_paired,
)
from swiglu_train.kernels.fp8_format import (  # noqa: E402
    FP8_DTYPE,
    SCALE_DTYPE,
    paired_saved_shapes,
    saved_shapes,
)
from swiglu_train.kernels.gated_autotune import set_block_shapes  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="records launches of the interpreter"
)

TARGET = GPUTarget("cuda", 90, 32)  # the H100's and H200's sm_90
# Constexprs that exist for the interpreter: the launchers pass True there, the GPU False.
GPU_VALUES = {"UPCAST": False, "INTERPRET": False}
DTYPES = (torch.float32, torch.bfloat16)  # fp32 takes the IEEE dots, 16-bit the tensor cores'


@dataclass(frozen=True)
class Lowering:
    """One compilation as the GPU's launch asks for it: the kernel, each parameter's type string
    with its specialization (a constexpr's value, an argument's alignment attribute), and the
    launch's keywords that are no parameter (num_warps, num_stages, ...)."""

    module: str
    kernel: str
    params: tuple[tuple[str, str, object], ...]
    options: tuple[tuple[str, object], ...]

    def __str__(self) -> str:
        params = (f"{n}={v}" if t == "constexpr" else f"{n}: {t}" for n, t, v in self.params)
        return f"{self.kernel}({', '.join(params)})"


@functools.cache
def _binder(fn: Callable) -> Callable:
    """Triton's own binder of a JIT launch for the Hopper target: (arguments, specialization,
    options), ints equal to 1 turned constexpr and alignment noted as on the GPU."""
    jit = JITFunction(fn)
    return create_function_from_signature(jit.signature, jit.params, make_backend(TARGET))


def _lowering(fn: Callable, named: dict, options: dict) -> Lowering:
    """What a launch of ``fn`` with these arguments and keywords compiles on the GPU."""
    bound, specialization, _ = _binder(fn)(**named, **options)
    params = tuple((n, *s) for n, s in zip(bound, specialization, strict=True))
    return Lowering(fn.__module__, fn.__name__, params, tuple(sorted(options.items())))


def _through_tma(named: dict) -> dict:
    """The gated GEMM's arguments as ``gated_gemm`` passes them on the GPU (``_tma_ok``):
    operands and outputs as tensor descriptors, boxed by its autotuner pre-hook."""
    tma = {**named, "USE_TMA": True}
    for name in ("x", "w", "h_out", "aux_out", "aux_up_out"):
        tma[name] = TensorDescriptor.from_tensor(named[name], [16, 16])
    set_block_shapes(tma)
    return tma


# Branches only the GPU launches take, added to each recorded launch of the kernel: TMA (the
# interpreter has none) and the persistent grid of two of the GPU's autotune configs.
GPU_VARIANTS: dict[str, tuple[Callable[[dict], dict], ...]] = {
    "_gated_gemm_kernel": (_through_tma, lambda named: {**_through_tma(named), "PERSISTENT": True}),
}


@triton.jit
def _dtype_pair_kernel(x_ptr, y_ptr):
    """The line a1306b4 took out of the experts' backward: the interpreter runs it, the GPU's
    front end cannot lower it."""
    a, b = x_ptr.dtype.element_ty, y_ptr.dtype.element_ty
    tl.store(y_ptr, tl.load(x_ptr).to(a).to(b))


# -- the launches, through the public launchers at tiny shapes ------------------------------


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Values only the interpreter's run reads: the lowering sees dtypes, strides, alignment."""
    return torch.randn(*shape).to(dtype)


def _fp8_copy(m: int, ffn: int, shapes: Callable = saved_shapes) -> tuple[torch.Tensor, ...]:
    """An e4m3 copy (zero bytes, unit scales) of a [m, 2 * ffn] preactivation."""
    q_shape, scale_shape = shapes(m, ffn)
    return torch.zeros(q_shape, dtype=FP8_DTYPE), torch.ones(scale_shape, dtype=SCALE_DTYPE)


def _drive_swiglu(dtype: torch.dtype) -> None:
    m, f = 5, 40
    preact, grad_h = _randn(m, 2 * f, dtype=dtype), _randn(m, f, dtype=dtype)
    swiglu.swiglu_forward(preact, torch.empty(m, f, dtype=dtype))
    swiglu.swiglu_backward(preact, grad_h, torch.empty_like(preact), None)
    swiglu.swiglu_backward(preact, grad_h, torch.empty_like(preact), torch.empty_like(grad_h))
    inplace_preact, inplace_grad_h = preact.clone(), grad_h.clone()
    swiglu.swiglu_backward(inplace_preact, inplace_grad_h, inplace_preact, inplace_grad_h)
    for tensor_amax, row_amax in ((True, False), (False, True), (True, True)):  # FP8's amaxes
        h = torch.empty_like(grad_h)
        swiglu.swiglu_backward(preact, grad_h, torch.empty_like(preact), h, tensor_amax, row_amax)
    over_grad_h = grad_h.clone()  # h over grad_h alone, grad_preact in its own buffer
    swiglu.swiglu_backward(preact, over_grad_h, torch.empty_like(preact), over_grad_h, True)
    for chunk in (f, 8):
        swiglu.swiglu_factors_(preact.clone(), torch.empty(m, f, dtype=dtype), chunk)


def _drive_float8(dtype: torch.dtype) -> None:
    preact = _randn(5, 80, dtype=dtype)
    amax = swiglu_float8.swiglu_row_amax(preact)
    swiglu_float8.swiglu_cast_e4m3(preact, 448.0 / amax.max().reshape(1))
    swiglu_float8.swiglu_cast_e4m3(preact, 448.0 / amax[:, None])


def _drive_float8_cast(dtype: torch.dtype) -> None:
    t = _randn(24, 40, dtype=dtype)
    for dim in (0, -1):  # the contraction along rows (a transposing cast) and along columns
        for rowwise in (False, True):
            amax = float8_cast.amax(t, dim, rowwise)
            for fp8 in float8_cast.FLOAT8_DTYPES:
                float8_cast.cast(t, 448.0 / amax, dim, fp8)
    float8_cast.amax_both(t)  # both rowwise casts' amaxes in one read
    for fp8 in float8_cast.FLOAT8_DTYPES:  # torchao's scale, 0-dim and per row
        float8_cast.amax_to_scale(float8_cast.amax(t, -1, False), fp8)
        float8_cast.amax_to_scale(float8_cast.amax(t, -1, True), fp8)


def _drive_fp8_saved(dtype: torch.dtype) -> None:
    m, f = 3, 130  # a partial second scale block
    q, scales = _fp8_copy(m, f)
    swiglu_fp8.swiglu_forward_fp8(
        _randn(m, 2 * f, dtype=dtype), torch.empty(m, f, dtype=dtype), q, scales
    )
    for tensor_amax, row_amax in ((False, False), (True, False), (False, True)):  # FP8's
        grad_h, grad_preact = _randn(m, f, dtype=dtype), torch.empty(m, 2 * f, dtype=dtype)
        swiglu_fp8.swiglu_backward_fp8(q, scales, grad_h, grad_preact, tensor_amax, row_amax)
    m, f = 3, 64
    swiglu_fp8_paired.swiglu_backward_fp8_paired(
        *_fp8_copy(m, f, paired_saved_shapes),
        _randn(m, f, dtype=dtype),
        torch.empty(m, 2 * f, dtype=dtype),
    )


def _drive_experts(dtype: torch.dtype) -> None:
    r, f, fp8_f = 5, 24, 130
    for weighted in (False, True):
        w, grad_w = (torch.rand(r), torch.empty(r)) if weighted else (None, None)
        for interleaved in (False, True):
            experts_swiglu.experts_backward_(
                _randn(r, 2 * f, dtype=dtype), _randn(r, f, dtype=dtype), w, grad_w, interleaved
            )
        experts_swiglu.experts_backward_fp8(
            *_fp8_copy(r, fp8_f),
            _randn(r, fp8_f, dtype=dtype),
            torch.empty(r, 2 * fp8_f, dtype=dtype),
            w,
            grad_w,
        )
    bags = torch.tensor([[0, 3], [1, 4], [2, 5]])
    for weights in (None, torch.rand(3, 2)):
        experts_swiglu.combine_rows(_randn(6, 20, dtype=dtype), bags, weights)


def _drive_experts_wgrad(dtype: torch.dtype) -> None:
    token, offsets = torch.tensor([0, 2, 1, 3, 0, 2]), torch.tensor([2, 2, 6], dtype=torch.int32)
    for scale in (None, torch.rand(6)):
        experts_wgrad.gathered_weight_grad(
            _randn(6, 20, dtype=dtype), _randn(4, 24, dtype=dtype), token, offsets, scale
        )


def _drive_fused_mlp(dtype: torch.dtype) -> None:
    m, d, f, o = 3, 24, 20, 18
    for bias in (False, True):
        for deterministic in (False, True):
            fused_mlp.fused_mlp(
                _randn(m, d, dtype=dtype),
                _randn(2 * f, d, dtype=dtype),
                _randn(2 * f, dtype=dtype) if bias else None,
                _randn(o, f, dtype=dtype),
                _randn(o, dtype=dtype) if bias else None,
                deterministic=deterministic,
            )


# (canonical, aux, bias): each aux kind and both biases in the canonical layout (two dots a
# tile) and in a packed one of chunk 16 (the wide single-dot tile); the canonical 16-bit call
# without aux or bias takes the rule's pinned tile, the others the autotuner's.
GATED_CALLS = (
    (True, "none", False),
    (True, "factors", True),
    (True, "preact", False),
    (False, "none", True),
    (False, "factors", False),
    (False, "preact", True),
)


def _drive_gated_gemm(dtype: torch.dtype) -> None:
    m, k, f = 4, 32, 32
    x = _randn(m, k, dtype=dtype)
    for canonical, aux, bias in GATED_CALLS:
        b = _randn(2 * f, dtype=dtype) if bias else None
        chunk = f if canonical else 16
        gated_gemm.gated_gemm(x, _randn(2 * f, k, dtype=dtype), b, chunk=chunk, aux=aux)
    for chunk in (f, 16):
        gated_gemm.factors_to_grad_(_randn(m, 2 * f, dtype=dtype), _randn(m, f, dtype=dtype), chunk)


DRIVERS = (
    _drive_swiglu,
    _drive_float8,
    _drive_float8_cast,
    _drive_fp8_saved,
    _drive_experts,
    _drive_experts_wgrad,
    _drive_fused_mlp,
    _drive_gated_gemm,
)


@pytest.fixture(scope="module")
def lowerings() -> list[Lowering]:
    """The distinct compilations of every launch the drivers (and the negative example) make
    under the interpreter, in launch order; the kernels still run."""
    seen: dict[Lowering, None] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            names = self.arg_names
            named = dict(zip(names, args, strict=False))  # the rest by keyword
            named |= {k: v for k, v in kwargs.items() if k in names}
            named |= {k: v for k, v in GPU_VALUES.items() if k in named}
            options = {k: v for k, v in kwargs.items() if k not in names}
            for variant in (dict, *GPU_VARIANTS.get(self.fn.__name__, ())):
                seen.setdefault(_lowering(self.fn, variant(named), options))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InterpretedFunction, "run", recording_run)
        for dtype in DTYPES:
            for drive in DRIVERS:
                drive(dtype)
        y = torch.zeros(1)
        _dtype_pair_kernel[(1,)](torch.ones(1, dtype=torch.bfloat16), y)
        assert y.item() == 1.0  # the interpreter took it
    return list(seen)


# -- lowering, in a child process without the interpreter -----------------------------------


def _lower(lowering: Lowering) -> str | None:
    """None when the launch lowers to TTIR for sm_90, else the error, as the GPU's compile
    would raise it (``JITFunction.run``, then the backend's "ttir" stage)."""
    fn = getattr(importlib.import_module(lowering.module), lowering.kernel)
    while not isinstance(fn, JITFunction):  # an autotuner's (or heuristics') kernel
        fn = fn.fn
    backend = make_backend(TARGET)
    options = backend.parse_options(dict(lowering.options))
    refused = [k for k, _ in lowering.options if k not in options.__dict__]
    if refused:  # JITFunction.run's KeyError; the interpreter drops such keywords
        return f"KeyError: keyword arguments {refused} are neither parameters nor options"
    signature = {name: ty for name, ty, _ in lowering.params}
    constexprs = {name: value for name, ty, value in lowering.params if ty == "constexpr"}
    attrs = {
        (i,): backend.parse_attr(spec)
        for i, (_, ty, spec) in enumerate(lowering.params)
        if ty != "constexpr" and isinstance(spec, str)
    }
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        module = ASTSource(fn, signature, constexprs, attrs).make_ir(
            TARGET,
            options,
            backend.get_codegen_implementation(options),
            backend.get_module_map(),
            context,
        )
        backend.make_ttir(module, {}, options, TARGET.arch)
    except Exception as e:  # any failure here is a failed GPU compile
        return f"{type(e).__module__}.{type(e).__qualname__}: {e}"
    return None


def lower_in_child(requests: str, results: str) -> None:
    """The child's entry: the pickled Lowerings in ``requests`` lowered, their errors pickled
    to ``results``."""
    lowerings = pickle.loads(Path(requests).read_bytes())
    Path(results).write_bytes(pickle.dumps([_lower(lowering) for lowering in lowerings]))


@pytest.fixture(scope="module")
def lowered(lowerings: list[Lowering], tmp_path_factory) -> dict[Lowering, str | None]:
    """Each lowering's error (None: it lowered), from one child process that imports the
    kernels with TRITON_INTERPRET unset, as the GPU's process does."""
    work = tmp_path_factory.mktemp("lowering")
    requests, results = work / "requests.pickle", work / "results.pickle"
    requests.write_bytes(pickle.dumps(lowerings))
    here = Path(__file__)
    package_root = str(Path(swiglu_train.__file__).parents[1])  # the parent's swiglu_train
    code = (
        f"import sys; sys.path[:0] = [{str(here.parent)!r}, {package_root!r}]; "
        f"from {here.stem} import lower_in_child; lower_in_child({str(requests)!r}, "
        f"{str(results)!r})"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(lowerings, pickle.loads(results.read_bytes()), strict=True))


def _package_kernels() -> Iterator[tuple[str, str]]:
    """(module, name) of every ``*_kernel`` JIT function defined in swiglu_train.kernels, in
    each module that imports Triton (the quack ones import CUTLASS instead)."""
    for info in pkgutil.iter_modules(swiglu_train.kernels.__path__):
        path = Path(swiglu_train.kernels.__path__[0]) / f"{info.name}.py"
        if not re.search(r"^(import|from) triton\b", path.read_text(), re.MULTILINE):
            continue
        module = importlib.import_module(f"swiglu_train.kernels.{info.name}")
        for obj in vars(module).values():
            while isinstance(obj, KernelInterface) and not isinstance(
                obj, InterpretedFunction | JITFunction
            ):
                obj = obj.fn
            if isinstance(obj, InterpretedFunction | JITFunction):
                fn = obj.fn
                if fn.__module__ == module.__name__ and fn.__name__.endswith("_kernel"):
                    yield fn.__module__, fn.__name__


def _of_package(lowerings: list[Lowering]) -> list[Lowering]:
    """The package's lowerings, without this module's negative example."""
    return [lowering for lowering in lowerings if lowering.module.startswith("swiglu_train.")]


def test_every_kernel_is_launched(lowerings: list[Lowering]) -> None:
    """A kernel no driver launches is never lowered: each new one needs its driver here."""
    launched = {(lowering.module, lowering.kernel) for lowering in _of_package(lowerings)}
    missing = sorted(set(_package_kernels()) - launched)
    assert not missing, f"no driver in {Path(__file__).name} launches: {missing}"


def test_every_boolean_constexpr_is_lowered_both_ways(lowerings: list[Lowering]) -> None:
    """Each flag's two branches are both lowered (the interpreter-only ones at the GPU's
    value): a constexpr branch the drivers never take is GPU code no CPU test compiles."""
    values: dict[tuple[str, str], set] = {}
    for lowering in _of_package(lowerings):
        for name, ty, value in lowering.params:
            if ty == "constexpr" and isinstance(value, bool) and name not in GPU_VALUES:
                values.setdefault((lowering.kernel, name), set()).add(value)
    one_way = sorted(f"{kernel}.{name}" for (kernel, name), seen in values.items() if len(seen) < 2)
    assert not one_way, f"lowered with one value only: {one_way}"


def test_every_launch_lowers_for_sm90(lowered: dict[Lowering, str | None]) -> None:
    """What the interpreter ran, the GPU compiles: each failure names the kernel, its argument
    types and constexprs, and the front end's error."""
    failures = [
        f"{lowering}:\n{lowered[lowering]}"
        for lowering in _of_package(list(lowered))
        if lowered[lowering] is not None
    ]
    assert not failures, f"{len(failures)} launch(es) do not compile for the GPU:\n\n" + (
        "\n\n".join(failures)
    )


def test_a_tuple_of_dtypes_fails_to_lower(lowered: dict[Lowering, str | None]) -> None:
    """The check can fail: the line a1306b4 took out, which the interpreter ran (the fixture
    launched it), is a CompilationError for the GPU."""
    (error,) = (e for lowering, e in lowered.items() if lowering.kernel == "_dtype_pair_kernel")
    assert error is not None
    assert error.startswith(f"{CompilationError.__module__}.{CompilationError.__qualname__}:")
