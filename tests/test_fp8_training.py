"""FP8 training through torchao's real ``convert_to_float8_training`` (issue 48): a ParMLP whose
fc1/fc2 it converted runs them through Float8Linear under impl ``normal``, runs their recipes in
its own GEMMs under ``drop_h`` (h not saved), and every other impl refuses in one line rather
than train in bf16 unannounced; ``patch`` leaves an MLP converted before it. Float8Linear runs
on the CPU (torch's CPU ``_scaled_mm``), so the numerics are checked here too; the cuda case is
the GPU test (H100/H200: real FP8 GEMMs)."""

import math
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import device_backends
from helpers import rel_err
from patch_models import hf_model
from torch import nn
from torchao import float8  # the fp8 extra, which the test extra brings
from torchao.float8.float8_linear import Float8Linear

import swiglu_train
from swiglu_train import ParMLP
from swiglu_train.integrations.patch import PatchedSwiGLU
from swiglu_train.ops import reference, use_backend

D, FFN, M = 64, 96, 48  # every dim a multiple of 16, as torch._scaled_mm needs
RECIPES = ("tensorwise", "rowwise")


def convert(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return float8.convert_to_float8_training(model, config=config)


class TorchaoMLP(nn.Module):
    """torchao's own FP8 SwiGLU MLP, the peer: two linears it converts, SwiGLU in torch."""

    def __init__(self, mlp: ParMLP) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * FFN, bias=False), nn.Linear(FFN, D, bias=False)
        self.load_state_dict(mlp.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(reference.swiglu(self.fc1(x)))


def outputs(mlp: nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = mlp(x)
    y.backward(grad_y)
    return {
        "y": y,
        "grad_x": x.grad,
        "grad_W1": mlp.fc1.weight.grad,
        "grad_W2": mlp.fc2.weight.grad,
    }


@pytest.mark.parametrize("impl", ["normal", "drop_h"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_the_converted_mlp_is_as_accurate_as_torchao_s_own(device, backend, recipe, impl):
    """Per tensor (y, grad_x, grad_W1, grad_W2), ParMLP on Float8Linear (normal through their
    forward, drop_h in its own GEMMs) is within 1.5x of torchao's FP8 MLP's distance from
    float64 on the same inputs, and that distance is FP8's, not bf16's: the FP8 GEMMs ran."""
    torch.manual_seed(0)
    mlp = ParMLP(D, FFN, impl=impl, device=device, dtype=torch.bfloat16)
    peer, exact = TorchaoMLP(mlp).to(device), TorchaoMLP(mlp).double().to(device)
    x = torch.randn(2, M // 2, D, device=device, dtype=torch.bfloat16)
    grad_y = torch.randn(2, M // 2, D, device=device, dtype=torch.bfloat16)
    expected = outputs(exact, x.double(), grad_y.double())
    convert(mlp, recipe), convert(peer, recipe)
    assert isinstance(mlp.fc1, Float8Linear) and isinstance(mlp.fc2, Float8Linear)
    with use_backend(backend):
        ours = outputs(mlp, x, grad_y)
    theirs = outputs(peer, x, grad_y)
    for name, value in ours.items():
        err, peer_err = rel_err(value, expected[name]), rel_err(theirs[name], expected[name])
        assert err <= 1.5 * peer_err, (name, err, peer_err)
        assert err > 2e-2, (name, err)  # here bf16 GEMMs sit near 4e-3, FP8's near 6e-2


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_drop_h_casts_as_float8_linear_and_keeps_x_and_the_preactivation_only(
    device, backend, recipe
):
    """drop_h's six GEMMs cast as the two Float8Linears do: its y and gradients match normal's
    (which runs their forwards) to bf16's rounding of the same FP8 products; what it keeps for
    backward is x and the preactivation, h [M, F] less than normal through Float8Linear."""
    from swiglu_train.memory import SavedTensorCounter

    torch.manual_seed(0)
    x = torch.randn(M, D, device=device, dtype=torch.bfloat16)
    grad_y = torch.randn(M, D, device=device, dtype=torch.bfloat16)
    normal = convert(ParMLP(D, FFN, impl="normal", device=device, dtype=torch.bfloat16), recipe)
    drop_h = convert(ParMLP(D, FFN, impl="drop_h", device=device, dtype=torch.bfloat16), recipe)
    drop_h.load_state_dict(normal.state_dict())
    with use_backend(backend):  # triton: fc2's e4m3 h from the preactivation, h not written
        ours, reference_ = outputs(drop_h, x, grad_y), outputs(normal, x, grad_y)
    assert torch.equal(ours["y"], reference_["y"])  # the same bytes into the same FP8 GEMMs
    for name, value in ours.items():
        assert rel_err(value, reference_[name]) < 1e-2, name
    saved = {}
    for name, mlp in (("normal", normal), ("drop_h", drop_h)):
        leaf = x.clone().requires_grad_()
        with use_backend(backend), SavedTensorCounter(exclude=[*mlp.parameters(), leaf]) as c:
            mlp(leaf)
        saved[name] = c.bytes
    preact, h = M * 2 * FFN * 2, M * FFN * 2
    amaxes = kept_amax_bytes(recipe, backend)
    assert saved["drop_h"] == preact + amaxes  # besides x, the caller's, which it keeps too
    assert saved["normal"] - saved["drop_h"] >= h - amaxes


def kept_amax_bytes(recipe: str, backend: str) -> int:
    """x's, W1's and W2's amaxes, found in forward and kept for backward in fp32: tensorwise one
    each; rowwise, where the fused casts run, backward's share of each one-read pair: grad_W1's
    of x per column (D), grad_x's of W1ᵀ per row (D), grad_h's of W2ᵀ per row (F)."""
    if recipe == "tensorwise":
        return 3 * 4
    return 4 * (2 * D + FFN) if backend == "triton" else 0


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(("device", "backend"), device_backends())
def test_drop_h_with_saved_fp8_runs_the_recipe_and_keeps_the_fp8_copy_alone(
    device, backend, recipe
):
    """saved_fp8 on converted linears: y is drop_h's on the same recipe to the bit (fc2's h
    comes from the bf16 preactivation); backward keeps the e4m3 copy and its scales, not the
    preactivation, and its gradients carry that rounding on top of FP8's GEMMs (seen 1.14x
    torchao's error at most), within 1.5x of torchao's FP8 MLP's distance from float64."""
    from swiglu_train.kernels.fp8_format import saved_shapes
    from swiglu_train.memory import SavedTensorCounter

    torch.manual_seed(0)
    kwargs = dict(device=device, dtype=torch.bfloat16)
    bf16_saved = ParMLP(D, FFN, impl="drop_h", **kwargs)
    exact, peer = TorchaoMLP(bf16_saved).double().to(device), TorchaoMLP(bf16_saved).to(device)
    fp8_saved = ParMLP(D, FFN, impl="drop_h", saved_fp8=True, **kwargs)
    fp8_saved.load_state_dict(bf16_saved.state_dict())
    for mlp in (bf16_saved, fp8_saved, peer):
        convert(mlp, recipe)
    x, grad_y = torch.randn(M, D, **kwargs), torch.randn(M, D, **kwargs)
    expected = outputs(exact, x.double(), grad_y.double())
    with use_backend(backend):
        ours, drop_h = outputs(fp8_saved, x, grad_y), outputs(bf16_saved, x, grad_y)
        leaf = x.clone().requires_grad_()
        with SavedTensorCounter(exclude=[*fp8_saved.parameters(), leaf]) as counter:
            fp8_saved(leaf)
    theirs = outputs(peer, x, grad_y)
    assert torch.equal(ours["y"], drop_h["y"])
    for name in ("grad_x", "grad_W1", "grad_W2"):
        err, peer_err = rel_err(ours[name], expected[name]), rel_err(theirs[name], expected[name])
        assert err <= 1.5 * peer_err, (name, err, peer_err)
        assert not torch.equal(ours[name], drop_h[name]), name  # the copy, not the preact
    q_shape, scale_shape = saved_shapes(M, FFN)
    amaxes = kept_amax_bytes(recipe, backend)
    copy = math.prod(q_shape) + 2 * math.prod(scale_shape)  # e4m3, bf16 scales
    assert counter.bytes == copy + amaxes


def test_drop_h_with_saved_fp8_on_converted_linears_frees_its_copy_once_read():
    """inplace (the default): a second backward is refused with saved_fp8's message, since the
    copy is gone; inplace=False keeps it, and the second backward gives the first's grads."""
    x = torch.randn(M, D, dtype=torch.bfloat16)
    mlp = convert(ParMLP(D, FFN, impl="drop_h", saved_fp8=True, dtype=torch.bfloat16))
    y = mlp(x.clone().requires_grad_())
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"saved_fp8=True\) freed its saved FP8 preact"):
        y.sum().backward()
    keeps = ParMLP(D, FFN, impl="drop_h", saved_fp8=True, inplace=False, dtype=torch.bfloat16)
    convert(keeps).load_state_dict(mlp.state_dict())
    y = keeps(x)
    y.sum().backward(retain_graph=True)
    first = keeps.fc1.weight.grad.clone()
    keeps.zero_grad()
    y.sum().backward()
    assert torch.equal(keeps.fc1.weight.grad, first) and first.abs().sum() > 0


def test_drop_h_with_other_converters_is_refused_in_one_line():
    class OtherConverter(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    mlp = ParMLP(D, FFN, impl="drop_h")
    mlp.fc2 = OtherConverter(FFN, D, bias=False)
    with pytest.raises(TypeError, match=r"drop_h runs torchao's Float8Linear recipes only"):
        mlp(torch.randn(M, D))


@pytest.mark.parametrize("impl", ["save_factors"])
def test_the_converter_on_a_model_with_par_mlp_is_refused_at_forward_in_one_line(impl):
    model = nn.Sequential(nn.Linear(D, D), ParMLP(D, FFN, impl=impl))
    convert(model)
    assert isinstance(model[1].fc1, Float8Linear)  # what the user's converter did
    with pytest.raises(TypeError) as info:
        model(torch.randn(M, D))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "ParMLP.fc1 is a torchao.float8.float8_linear.Float8Linear, which replaces nn.Linear's"
    )
    assert f"impl {impl!r} runs its own GEMMs" in message
    assert "convert_to_float8_training" in message and "use impl 'drop_h' or 'normal'" in message


def test_a_patched_model_takes_the_converter_under_normal_and_drop_h_only():
    ids = torch.randint(0, 64, (2, 8))
    refused = hf_model("llama")
    swiglu_train.patch(refused, "save_factors")
    convert(refused)
    with pytest.raises(TypeError, match=r"^ParMLP\.fc1 is a .*Float8Linear.* 'save_factors'"):
        refused(ids)

    for impl, saved_fp8 in (("normal", False), ("drop_h", False), ("drop_h", True)):
        model = hf_model("llama")
        keys = set(model.state_dict())
        swiglu_train.patch(model, impl, saved_fp8=saved_fp8)
        convert(model)
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp, PatchedSwiGLU) and isinstance(mlp.fc1, Float8Linear)
        assert mlp.saved_fp8 == saved_fp8
        assert set(model.state_dict()) == keys  # the host's keys, as before the conversion
        model(ids).logits.sum().backward()
        assert mlp.fc1.weight.grad is not None


def test_patch_leaves_an_mlp_converted_before_it_with_the_reason():
    """Patched after the converter, a ParMLP would take Float8Linear's weights into bf16
    GEMMs: patch leaves the MLP as it is and its report says what to do."""
    model = hf_model("llama")
    convert(model)
    before = model.model.layers[0].mlp
    report = swiglu_train.patch(model, "normal")
    assert report.replaced == [] and model.model.layers[0].mlp is before
    reasons = {entry.reason for entry in report.left}
    assert len(reasons) == 1 and len(report.left) == 2
    reason = reasons.pop()
    assert "gate_proj is a Float8Linear whose forward is not nn.Linear's" in reason
    assert (
        "convert_to_float8_training" in reason
        and "patch first with impl 'drop_h' or 'normal'" in reason
    )


@pytest.mark.parametrize(
    "variant",
    [
        "drop_h_float8_rowwise",
        "normal_float8_tensorwise",
        "torchao_float8_tensorwise",
        "drop_h_float8_tensorwise_compile",
        "drop_h+fp8_float8_rowwise_compile",
    ],
)
def test_the_benchmark_s_float8_variants_run_fp8_gemms_on_the_shared_weights(variant):
    """bench's FP8 variants (ours on converted linears, torchao's own MLP) read the layer's
    shared weights and run FP8 GEMMs: y is FP8's distance from the float64 MLP, not bf16's."""
    from swiglu_train.bench.mlp.variants import BUILDERS, LayerWeights

    torch.manual_seed(0)
    w = LayerWeights.random(D, FFN, D, torch.bfloat16, "cpu")
    x = torch.randn(M, D, dtype=torch.bfloat16)
    with use_backend("torch"):
        y = BUILDERS[variant](w)(x)
    y.sum().backward()
    exact = reference.mlp(x.double(), w.fc1.double(), None, w.fc2.double(), None)
    assert 2e-2 < rel_err(y, exact) < 0.15
    assert w.fc1.grad is not None and w.fc2.grad is not None


def test_a_weight_that_arrives_cast_is_not_cast_again():
    """FSDP2's float8 all-gather hands the GEMM a weight torchao cast already: drop_h's GEMMs
    take it as it is, as Float8Linear's own do, rather than quantize it twice."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    from swiglu_train.ops import float8_casts

    linear = convert(nn.Sequential(nn.Linear(D, D, bias=False)))[0]
    gemms = float8_casts.Float8Gemms.of(linear)
    w = linear.weight.detach().t()
    cast = hp_tensor_to_float8_dynamic(
        w, gemms.config.cast_config_weight.target_dtype, gemms.mm_config,
        gemm_input_role=GemmInputRole.WEIGHT,
    )  # fmt: skip
    assert (
        float8_casts.cast_operand(cast, gemms.config.cast_config_weight, "WEIGHT", 0, gemms) is cast
    )
    again = float8_casts.cast_operand(w, gemms.config.cast_config_weight, "WEIGHT", 0, gemms)
    assert again is not w and torch.equal(again._data, cast._data)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(  # a Triton kernel: the torch backend casts the h it computes
    ("device", "backend"), [p for p in device_backends() if p.values[1] == "triton"]
)
def test_h_cast_from_the_preactivation_is_torchao_s_cast_of_h(device, backend, recipe):
    """fc2's e4m3 operand made without writing h: the same bytes, scales and roles as
    torchao's cast of the h the forward kernel writes (a zero row and a large one included:
    the amax floor and the per-row scales)."""
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    from swiglu_train.ops import float8_casts, float8_mlp
    from swiglu_train.ops.activation import swiglu_fwd

    torch.manual_seed(0)
    preact = torch.randn(37, 2 * 40, device=device, dtype=torch.bfloat16) * 3
    preact[5] = 0
    preact[9] *= 50
    linear = convert(nn.Sequential(nn.Linear(40, 16, bias=False)), recipe)[0].to(device)
    gemms = float8_casts.Float8Gemms.of(linear)
    cast = gemms.config.cast_config_input
    with use_backend(backend):
        ours = float8_mlp.fc2_input(preact, gemms)
        h = swiglu_fwd(preact)
    theirs = hp_tensor_to_float8_dynamic(
        h, cast.target_dtype, gemms.mm_config, gemm_input_role=GemmInputRole.INPUT,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(-1, cast.scaling_granularity),
        round_scales_to_power_of_2=gemms.config.round_scales_to_power_of_2,
    )  # fmt: skip
    assert isinstance(ours, Float8TrainingTensor)
    assert torch.equal(ours._data.view(torch.uint8), theirs._data.view(torch.uint8))
    assert torch.equal(ours._scale, theirs._scale)
    assert (ours._axiswise_dim, ours._gemm_input_role) == (
        theirs._axiswise_dim,
        theirs._gemm_input_role,
    )


def test_training_fp8_gemms_uncompiled_on_a_gpu_is_flagged_and_compiled_is_not():
    """Uncompiled, torchao's casts are separate kernels: FP8 ran 2.4-3.8x the bf16 GEMMs on an
    H100. The flag holds on a GPU with grad outside torch.compile only."""
    from swiglu_train.layers.par_mlp import uncompiled_float8_training

    assert uncompiled_float8_training("cuda") and not uncompiled_float8_training("cpu")
    with torch.no_grad():
        assert not uncompiled_float8_training("cuda")

    @torch.compile(backend="eager")
    def flagged(t: torch.Tensor) -> torch.Tensor:
        return t + (1.0 if uncompiled_float8_training("cuda") else 0.0)

    assert flagged(torch.zeros(1)).item() == 0.0


@pytest.mark.parametrize("impl", ["drop_h", "normal"])
def test_a_converted_mlp_warns_once_where_its_fp8_gemms_would_run_unfused(monkeypatch, impl):
    from swiglu_train.layers import par_mlp

    mlp = nn.Sequential(ParMLP(D, FFN, impl=impl))
    convert(mlp)
    x = torch.randn(M, D, requires_grad=True)
    with use_backend("torch"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mlp(x)  # on the CPU: no warning
        monkeypatch.setattr(par_mlp, "uncompiled_float8_training", lambda device_type: True)
        mlp(x)
    assert [str(w.message) for w in seen] == [par_mlp.UNCOMPILED_FLOAT8_WARNING]


def moe_training_convert(model: nn.Module, kind: type) -> nn.Module:
    """torchao's MoE FP8 training conversion (torchtitan's float8 for MoE), applied to the
    modules of ``kind``: their weights become Float8TrainingWeightWrapperTensor."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: isinstance(m, kind))
    return model


@pytest.mark.parametrize("impl", ["normal", "drop_h"])
def test_experts_whose_weights_a_moe_training_conversion_wrapped_are_refused(impl):
    """torchao's MoE FP8 training reroutes torch._grouped_mm and mm on its wrapped weights:
    some of the experts' GEMMs would run in FP8 and the rest (the Triton passes, the weight
    gradients) would not. The first forward refuses in one line that names the class."""
    from swiglu_train.layers.experts import ParExperts

    experts = moe_training_convert(ParExperts(4, D, FFN, impl=impl, dtype=torch.bfloat16),
                                   ParExperts)  # fmt: skip
    assert type(experts.fc1_weight).__name__ == "Float8TrainingWeightWrapperTensor"
    x = torch.randn(M, D, dtype=torch.bfloat16)
    indices, weights = torch.randint(0, 4, (M, 2)), torch.rand(M, 2)
    with pytest.raises(TypeError, match=r"^experts\.fc1_weight is a torchao\.prototype\.moe_"
                       r"training\.tensor\.Float8TrainingWeightWrapperTensor, a tensor subclass"
                       ) as info:  # fmt: skip
        experts(x, indices, weights)
    assert "\n" not in str(info.value) and "filter_fn" in str(info.value)


def test_a_dense_weight_that_a_conversion_wrapped_is_refused_and_plain_ones_pass():
    """The same wrapper on ParMLP's nn.Linear weights (torchao's MoE config also reroutes mm
    and linear): refused at forward, naming the weight. A plain tensor in a weight's place (a
    parametrization's output is one) is no conversion and runs."""
    mlp = moe_training_convert(ParMLP(D, FFN, impl="drop_h"), nn.Linear)
    with pytest.raises(TypeError, match=r"^ParMLP\.fc1\.weight is a torchao\..*Wrapper"):
        mlp(torch.randn(M, D))
    plain = ParMLP(D, FFN, impl="drop_h")
    expected = plain(x := torch.randn(M, D))
    weight = plain.fc1.weight.detach()
    del plain.fc1.weight
    plain.fc1.weight = weight  # a plain tensor attribute, as functional_call sets
    assert torch.equal(plain(x), expected)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiled_drop_h_keeps_what_eager_keeps_and_no_fp8_copy_of_x(recipe):
    """Under torch.compile the partitioner moved grad_W1's cast of x into forward and kept its
    fp8 bytes across the step (M·D bytes a layer, beside the bf16 x that lives anyway): that
    cast now runs in backward, from x. A compiled step saves what the eager one saves (the
    preactivation and at most a few fp32 scalars more) and gives its y and gradients bit for
    bit."""
    from swiglu_train.memory import SavedTensorCounter

    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        mlp = ParMLP(D, FFN, impl="drop_h", dtype=torch.bfloat16)
        model = convert(nn.Sequential(mlp), recipe)
        model = torch.compile(model) if compiled else model
        x = torch.randn(M, D, dtype=torch.bfloat16, requires_grad=True)
        with use_backend("torch"), SavedTensorCounter(exclude=[*model.parameters(), x]) as c:
            y = model(x)
        y.backward(torch.ones_like(y))
        grads = (x.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad)
        results[compiled] = (c.bytes, y.detach(), *grads)
    (eager_bytes, *eager), (compiled_bytes, *compiled) = results[False], results[True]
    preact = M * 2 * FFN * 2
    assert eager_bytes >= preact and 0 <= compiled_bytes - eager_bytes <= 4 * 4
    assert compiled_bytes - preact < M * D  # no fp8 copy of x
    for ours, theirs in zip(compiled, eager, strict=True):
        assert torch.equal(ours, theirs)


COLD_COMPILE = """
import torch
import torch._dynamo.utils
from torch import nn
from torchao import float8
from swiglu_train import ParMLP
from swiglu_train.ops import use_backend

mlp = ParMLP(64, 96, impl="drop_h", dtype=torch.bfloat16)
model = torch.compile(float8.convert_to_float8_training(nn.Sequential(mlp)))
x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
with use_backend("torch"):
    model(x).sum().backward()
print("graph breaks:", sum(torch._dynamo.utils.counters["graph_break"].values()))
"""


@pytest.mark.slow
def test_a_cold_compile_traces_the_fp8_mlp_whole():
    """In a fresh process, the first FP8 GEMM loads torchao's names inside the compiled block:
    that must not break the graph (a SimpleNamespace did, and the FP8 MLP then ran uncompiled
    in every compiled step after)."""
    run = subprocess.run(
        [sys.executable, "-c", COLD_COMPILE], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "graph breaks: 0" in run.stdout, run.stdout + run.stderr[-2000:]
