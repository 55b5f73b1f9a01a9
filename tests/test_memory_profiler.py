"""The profiler's saved-bytes figures are exact, per layer and per impl, on CPU."""

import pytest
import torch
from memory_models import Stack
from torch import nn

from swiglu_train import ParMLP
from swiglu_train.memory import MemoryProfiler

M, D, FFN, LAYERS = 37, 16, 24, 4


def profile(model: nn.Module, x: torch.Tensor, per_layer: bool = True):
    profiler = MemoryProfiler(model, per_layer=per_layer)
    with profiler.step(0) as p:
        loss = model(x).sum()  # sum() saves nothing, so every saved byte is the model's
        p.forward_done()
        loss.backward()
    return profiler.records[-1]


@pytest.mark.parametrize("impl", ["normal", "drop_h"])
def test_bare_parmlp_stack_per_layer_bytes_are_analytic(impl):
    model = nn.Sequential(*[ParMLP(D, FFN, impl=impl) for _ in range(LAYERS)])
    x = torch.randn(M, D, requires_grad=True)
    record = profile(model, x.clone().requires_grad_())
    per_layer = M * D + M * 2 * FFN + (M * FFN if impl == "normal" else 0)  # x, preact, h
    assert [layer.saved_bytes for layer in record.layers] == [per_layer * 4] * LAYERS
    assert record.saved_bytes == LAYERS * per_layer * 4
    assert record.impl_saved_bytes == {impl: LAYERS * per_layer * 4}
    cumulative = [layer.cumulative_saved_bytes for layer in record.layers]
    assert cumulative == [per_layer * 4 * (i + 1) for i in range(LAYERS)]
    assert record.after_forward_MiB is None and record.peak_MiB is None  # CPU: no allocator


def test_drop_h_saves_exactly_layers_m_f_itemsize_less_in_blocks():
    x = torch.randn(3, M, D)
    records = {}
    for impl in ("normal", "drop_h"):
        torch.manual_seed(0)
        records[impl] = profile(Stack(LAYERS, D, FFN, impl), x)
    normal, drop_h = records["normal"], records["drop_h"]
    tokens = 3 * M
    assert normal.saved_bytes - drop_h.saved_bytes == LAYERS * tokens * FFN * 4
    for a, b in zip(normal.layers, drop_h.layers, strict=True):
        assert a.name == b.name and a.name.startswith("layers.")
        assert a.mlp_saved_bytes - b.mlp_saved_bytes == tokens * FFN * 4
        assert b.mlp_saved_bytes == (tokens * D + tokens * 2 * FFN) * 4  # LayerNorm out, preact
        assert a.saved_bytes > a.mlp_saved_bytes  # the block also holds the norm's tensors


def test_metrics_keys():
    record = profile(Stack(2, D, FFN, "drop_h"), torch.randn(M, D))
    keys = set(record.metrics())
    assert {"memory/saved_MiB", "memory/impl/drop_h/saved_MiB"} <= keys
    for i in range(2):
        assert {
            f"memory/layer/{i}/{k}_MiB" for k in ("saved", "cumulative_saved", "mlp_saved")
        } <= keys
    assert not any("peak" in k or "after_forward" in k for k in keys)  # CUDA-only figures


def test_per_layer_off_records_totals_only():
    model = Stack(2, D, FFN, "drop_h")
    record = profile(model, torch.randn(M, D), per_layer=False)
    assert record.layers == [] and record.impl_saved_bytes == {}
    assert record.saved_bytes == profile(model, torch.randn(M, D)).saved_bytes


def test_hooks_are_removed_and_misuse_is_named():
    model = Stack(2, D, FFN, "normal")
    profiler = MemoryProfiler(model)
    with pytest.raises(RuntimeError, match="outside a step"):
        profiler.forward_done()
    profiler.begin(0)
    with pytest.raises(RuntimeError, match="begin called twice"):
        profiler.begin(1)
    loss = model(torch.randn(M, D))
    with pytest.raises(RuntimeError, match="before forward_done"):
        profiler.backward_done()
    profiler.forward_done()
    with pytest.raises(RuntimeError, match="forward_done called twice"):
        profiler.forward_done()
    loss.backward()
    profiler.backward_done()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_exception_in_forward_leaves_no_hooks():
    model = Stack(2, D, FFN, "normal")
    profiler = MemoryProfiler(model)
    with pytest.raises(RuntimeError, match="normalized_shape"), profiler.step(0):
        model(torch.randn(M, D + 1))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with profiler.step(1) as p:  # and the profiler is usable again
        loss = model(torch.randn(M, D))
        p.forward_done()
        loss.backward()
    assert profiler.records[-1].step == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_after_forward_differs_by_exactly_the_dropped_h():
    # Every activation is a whole number of 2 MiB: the CUDA allocator hands out a cached block
    # up to 1 MiB larger than asked for without splitting it, which would blur an exact count.
    m, d, f, layers = 2048, 1024, 2048, 3
    after = {}
    for impl in ("normal", "drop_h"):
        model = nn.Sequential(
            *[ParMLP(d, f, impl=impl, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        )
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        model(x).sum().backward()  # warm-up: autotuning, cuBLAS workspaces
        record = profile(model, x)
        assert record.forward_peak_MiB >= record.after_forward_MiB > 0
        assert record.backward_peak_MiB > 0 and record.peak_MiB >= record.backward_peak_MiB
        assert [layer.allocated_MiB for layer in record.layers] == sorted(
            layer.allocated_MiB for layer in record.layers
        )  # the depth curve grows layer by layer
        after[impl] = record.after_forward_MiB
    assert (after["normal"] - after["drop_h"]) * 2**20 == layers * m * f * 2


def test_a_step_inside_the_user_s_saved_tensors_hooks_keeps_them():
    """torch applies only the innermost hooks: the profiler's must hand each tensor on to the
    user's (activation offloading, say), or the measured step would silently run without it."""
    model = nn.Sequential(*[ParMLP(D, FFN, impl="drop_h") for _ in range(2)])
    x = torch.randn(M, D, requires_grad=True)
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.shape)
        return t

    def unpack(t):
        unpacked.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        record = profile(model, x)
    assert record.saved_bytes == 2 * (M * D + M * 2 * FFN) * 4  # x and preact per layer
    assert len(packed) >= 4 and len(unpacked) == len(packed)


def test_two_overlapping_profilers_each_count_the_step():
    model = nn.Sequential(*[ParMLP(D, FFN, impl="drop_h") for _ in range(2)])
    outer, inner = MemoryProfiler(model), MemoryProfiler(model)
    with outer.step(0) as o, inner.step(0) as i:
        loss = model(torch.randn(M, D, requires_grad=True)).sum()
        i.forward_done()
        o.forward_done()
        loss.backward()
    expected = 2 * (M * D + M * 2 * FFN) * 4
    assert outer.records[-1].saved_bytes == inner.records[-1].saved_bytes == expected


class _Experts(nn.Module):
    """A block whose two ParMLP experts sit in a ModuleList and read one input."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(ParMLP(D, FFN, impl="drop_h") for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts[0](x) + self.experts[1](x)


class _MoEStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Experts() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_a_module_list_inside_a_block_is_not_a_layer_and_shared_inputs_count_once():
    from swiglu_train.memory import find_layers, model_config

    model = _MoEStack()
    layers, _ = find_layers(model)
    assert [name for name, _ in layers] == [f"layers.{i}" for i in range(LAYERS)]
    assert model_config(model)["num_layers"] == LAYERS
    record = profile(model, torch.randn(M, D))
    assert [layer.name for layer in record.layers] == [f"layers.{i}" for i in range(LAYERS)]
    per_layer = (M * D + 2 * M * 2 * FFN) * 4  # one x for both experts, a preact each
    assert [layer.mlp_saved_bytes for layer in record.layers] == [per_layer] * LAYERS
    assert (
        record.impl_saved_bytes == {"drop_h": LAYERS * per_layer} == {"drop_h": record.saved_bytes}
    )


def test_a_list_of_lists_still_yields_the_blocks():
    from swiglu_train.memory import find_layers

    model = nn.ModuleList([nn.ModuleList([ParMLP(D, FFN)] * 1) for _ in range(2)])
    assert [name for name, _ in find_layers(model)[0]] == ["0.0", "1.0"]


def test_a_saved_sparse_tensor_is_measured_not_crashed():
    """A saved sparse tensor has no storage of its own; its indices and values are counted."""
    adjacency = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2], [1, 2, 3]]), torch.ones(3), (M, M))
    lin = nn.Linear(D, D)
    profiler = MemoryProfiler(lin)
    with profiler.step(0) as p:
        loss = torch.sparse.mm(adjacency, lin(torch.randn(M, D))).sum()
        p.forward_done()
        loss.backward()
    assert profiler.records[-1].saved_bytes == (2 * 3 * 8 + 3 * 4) + M * D * 4  # adj, lin out


def test_dtensor_parameters_are_excluded_and_their_activations_counted(one_rank_gloo):
    """Tensor parallelism and FSDP2 make parameters DTensors, which have no storage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    lin = parallelize_module(nn.Linear(D, D), init_device_mesh("cpu", (1,)), ColwiseParallel())
    record = profile(lin, torch.randn(M, D, requires_grad=True))
    assert record.saved_bytes == M * D * 4  # x; the weight is a parameter


def test_a_step_body_that_skips_forward_done_leaves_no_hooks():
    model = Stack(2, D, FFN, "normal")
    profiler = MemoryProfiler(model)
    with pytest.raises(RuntimeError, match="before forward_done"), profiler.step(0):
        model(torch.randn(M, D))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert profiler.records == []
    with profiler.step(1) as p:  # and the profiler is usable again
        loss = model(torch.randn(M, D))
        p.forward_done()
        loss.backward()
    assert [r.step for r in profiler.records] == [1]


class MkldnnRelu(nn.Module):
    """A Linear whose activation runs on mkldnn: relu saves its mkldnn output for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x).to_mkldnn()).to_dense()


def test_a_saved_mkldnn_tensor_is_sized_from_its_shape_and_the_step_trains():
    """mkldnn tensors have no storage to read; the step must neither crash nor lose them."""
    model = MkldnnRelu()
    record = profile(model, torch.randn(M, D))
    assert model.lin.weight.grad is not None and model.lin.weight.grad.abs().sum() > 0
    # Linear saves x, to_mkldnn its dense input; relu and to_dense save one mkldnn output.
    assert record.saved_bytes == 3 * M * D * 4


def test_a_step_that_only_reruns_a_retained_graph_packs_no_tensor():
    """saved_tensors tells a backward with no forward of its own from a forward saving 0 B."""
    model = Stack(2, D, FFN, "normal")
    profiler = MemoryProfiler(model)
    with profiler.step(0) as p:
        loss = model(torch.randn(M, D))
        p.forward_done()
        loss.backward(retain_graph=True)
    with profiler.step(0) as p:
        p.forward_done()
        loss.backward()
    first, again = profiler.records
    assert first.saved_tensors > 0 and first.saved_bytes > 0
    assert again.saved_tensors == 0 and again.saved_bytes == 0
