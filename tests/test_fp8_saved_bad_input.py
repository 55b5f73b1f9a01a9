"""saved_fp8 on inputs it cannot serve: a GPU without FP8, and non-finite preactivations.

The impls and dtypes: tests/test_fp8_saved.py (every impl but drop_h is refused with its
reason; fp32, fp16 and bf16 are all served).
"""

import pytest
import torch
from conftest import device_backends

from swiglu_train import ParMLP
from swiglu_train.kernels.fp8_format import BLOCK, MIN_CAPABILITY, capability_error
from swiglu_train.ops import use_backend

M, D, FFN, OUT = 8, 16, 200, 16  # FFN 200: gate and up blocks of 128 and 72 columns
INF, NAN = float("inf"), float("nan")


def test_a_gpu_below_8_9_is_refused_with_the_reason():
    assert capability_error((8, 6), "cuda:1") == (
        "saved_fp8=True needs a GPU with FP8 (e4m3) support, compute capability 8.9+ (Ada, "
        "Hopper or newer): its Triton kernels store float8e4nv, which Triton compiles for "
        "sm_89 and up only; cuda:1 is 8.6. Leave saved_fp8 off there (drop_h keeps its "
        "preactivation in bf16)"
    )


@pytest.mark.parametrize(
    "capability", [(7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (12, 0)]
)
def test_the_gpus_served_are_those_triton_compiles_float8e4nv_for(capability):
    """Asked of Triton's own CUDA backend (no GPU needed): the kernels store through
    tl.float8e4nv, so a GPU is served exactly where Triton supports that type."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    arch = capability[0] * 10 + capability[1]
    options = CUDABackend(GPUTarget("cuda", arch, 32)).parse_options({})
    served = capability_error(capability, "cuda:0") is None
    assert served == ("fp8e4nv" in options.supported_fp8_dtypes)
    assert served == (capability >= MIN_CAPABILITY)


def grads(saved_fp8: bool, where: str, value: float, device, backend: str) -> dict:
    """y and every gradient (on CPU) of a bf16 ParMLP step with one non-finite ``value`` put
    ``where``; the same weights and inputs with and without ``saved_fp8``."""
    torch.manual_seed(0)
    mlp = ParMLP(D, FFN, OUT, bias=True, saved_fp8=saved_fp8, dtype=torch.bfloat16)
    x = torch.randn(M, D, dtype=torch.bfloat16)
    grad_y = torch.randn(M, OUT, dtype=torch.bfloat16)
    with torch.no_grad():
        target = {"x": x, "gate weight": mlp.fc1.weight, "up weight": mlp.fc1.weight,
                  "fc2 weight": mlp.fc2.weight}[where]  # fmt: skip
        index = {"x": (3, 5), "gate weight": (7, 2), "up weight": (FFN + 150, 2),
                 "fc2 weight": (4, 130)}[where]  # fmt: skip
        target[index] = value
    mlp.to(device)
    x = x.to(device).requires_grad_()
    with use_backend(backend):
        y = mlp(x)
        y.backward(grad_y.to(device))
    got = {"y": y.detach(), "x": x.grad, "w1": mlp.fc1.weight.grad, "b1": mlp.fc1.bias.grad,
           "w2": mlp.fc2.weight.grad, "b2": mlp.fc2.bias.grad}  # fmt: skip
    return {name: t.cpu() for name, t in got.items()}


def block_rows(column: int) -> torch.Tensor:
    """The fc1 rows (gate and up) of the 128-column block holding preactivation ``column``."""
    start = column % FFN // BLOCK * BLOCK
    block = torch.zeros(FFN, dtype=torch.bool)
    block[start : start + BLOCK] = True
    return torch.cat([block, block])


CASES = [(where, value) for where in ("x", "gate weight", "up weight", "fc2 weight")
         for value in (INF, -INF, NAN)]  # fmt: skip
# The interpreter is slow: its kernels see one case of each kind (the torch path, all of them).
INTERPRETED = [("x", NAN), ("gate weight", INF), ("up weight", -INF)]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize(
    ("device", "backend", "where", "value"),
    [
        pytest.param(*p.values, where, value, marks=p.marks, id=f"{p.id}-{where}-{value}")
        for p in device_backends()
        for where, value in CASES
        if p.id != "cpu-triton" or (where, value) in INTERPRETED
    ],
)
def test_non_finite_inputs_give_the_bf16_path_s_non_finite_grads(device, backend, where, value):
    """Every y and gradient entry that drop_h makes non-finite, the FP8 copy does too: never a
    silently finite one. Through x or fc2's weight (whole tokens, or grad_h) the entries are
    the same; a non-finite fc1 row spoils the 128-column block of the preactivation it feeds
    (the block's scale is non-finite), so the FP8 path's grad_W1, grad_b1 and grad_W2 are
    non-finite over that block's gate and up rows (grad_W2: columns), no further."""
    plain = grads(False, where, value, device, backend)
    fp8 = grads(True, where, value, device, backend)
    assert not plain["w1"].isfinite().all()  # the case makes the bf16 path non-finite at all
    for name in plain:
        bad_plain, bad_fp8 = ~plain[name].isfinite(), ~fp8[name].isfinite()
        assert not (bad_plain & ~bad_fp8).any(), name  # nothing non-finite turns finite
        extra = bad_fp8 & ~bad_plain
        if where in ("x", "fc2 weight") or name in ("y", "x", "b2"):
            assert not extra.any(), name
            continue
        rows = block_rows(7 if where == "gate weight" else 150)
        allowed = {"w1": rows[:, None], "b1": rows, "w2": rows[None, :FFN]}[name]
        assert extra.any() and not (extra & ~allowed).any(), name
