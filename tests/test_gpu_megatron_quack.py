"""The Megatron adapter running the quack impls on CUDA: the same function and grads as drop_h.

Needs a GPU with quack and megatron-core together (carry .whl, .whlx and .whlm: see
python3 scripts/device.py wheels). A world of one NCCL rank at TP=1, so Megatron's real CUDA
paths run, not the CPU shims of megatron_support.
"""

import os

import pytest
import torch
from helpers import rel_err
from megatron_support import free_port, swiglu_config  # skips this file without megatron

from megatron.core import parallel_state  # isort: skip
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # isort: skip
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # isort: skip
from megatron.core.transformer.mlp import MLPSubmodules  # isort: skip
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # isort: skip

from swiglu_train.integrations.megatron import ParMLPMegatron
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops.quack_mlp import quack_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not quack_available(), reason="needs quack-kernels and an sm_90+ GPU"),
]


@pytest.fixture
def one_rank():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run(impl: str, state: dict | None, x: torch.Tensor) -> tuple[dict, dict]:
    """(outputs and grads, state_dict) of a bf16 ParMLPMegatron of ``impl`` on ``x``."""
    config = swiglu_config(
        hidden_size=1024, ffn_hidden_size=2816, bf16=True, params_dtype=torch.bfloat16
    )
    spec = ModuleSpec(
        module=ParMLPMegatron,
        params={"impl": impl},
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    mlp = build_module(spec, config=config).cuda()
    if state is not None:
        mlp.load_state_dict(state)
    x = x.detach().clone().requires_grad_()
    out, bias = mlp(x)
    assert bias is None
    out.float().square().sum().backward()
    results = {"out": out.detach(), "x": x.grad}
    for name, p in mlp.named_parameters():  # fc1's grads compared in the canonical layout
        fc1 = name.startswith("linear_fc1.")
        results[name] = relayout(p.grad, mlp.fc1_layout, CANONICAL) if fc1 else p.grad
    return results, mlp.state_dict()


@pytest.mark.parametrize("impl", ["drop_h_quack", "save_factors_quack"])
def test_adapter_computes_drop_h_on_quack(one_rank, impl):
    """drop_h's canonical state loads into either (save_factors_quack packs it, chunk 1)."""
    x = torch.randn(512, 4, 1024, device="cuda", dtype=torch.bfloat16)  # [seq, batch, hidden]
    expected, state = run("drop_h", None, x)
    actual, _ = run(impl, state, x)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert rel_err(actual[name], value) < 1e-2, name  # two bf16 GEMM paths
