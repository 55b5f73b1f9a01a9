"""The memory profiler on FP8-saved MLPs: the e4m3 copy at 1 byte an element, its bf16 scales,
and the impl label drop_h+fp8 that keeps them apart from bf16 drop_h's figures."""

import torch
from torch import nn

from swiglu_train import ParMLP
from swiglu_train.kernels.fp8_format import n_blocks
from swiglu_train.memory import MemoryProfiler, model_config
from swiglu_train.ops import use_backend

M, D, FFN = 37, 16, 200  # FFN 200: per half a block of 128 columns and one of 72


def profile(model: nn.Module, profiler: MemoryProfiler, dtype: torch.dtype):
    x = torch.randn(M, D, dtype=dtype, requires_grad=True)
    with use_backend("torch"), profiler.step(len(profiler.records)) as p:
        loss = model(x).float().sum()  # saves nothing: every saved byte is the model's
        p.forward_done()
        loss.backward()
    return profiler.records[-1]


def test_fp8_layers_are_counted_at_their_true_bytes_under_their_own_label():
    dtype = torch.bfloat16
    model = nn.Sequential(
        *[ParMLP(D, FFN, saved_fp8=i < 2, dtype=dtype) for i in range(4)]  # 2 FP8, 2 bf16
    )
    x = M * D * 2
    fp8 = x + M * 2 * FFN * 1 + M * 2 * n_blocks(FFN) * 2  # x, e4m3 values, bf16 scales
    bf16 = x + M * 2 * FFN * 2  # x, the preactivation
    profiler = MemoryProfiler(model)
    record = profile(model, profiler, dtype)
    assert [layer.saved_bytes for layer in record.layers] == [fp8, fp8, bf16, bf16]
    assert record.impl_saved_bytes == {"drop_h+fp8": 2 * fp8, "drop_h": 2 * bf16}
    assert record.saved_bytes == 2 * fp8 + 2 * bf16
    assert record.metrics()["memory/impl/drop_h+fp8/saved_MiB"] == 2 * fp8 / 2**20
    assert model_config(model)["mlp_impl"] == "drop_h,drop_h+fp8"

    for layer in model:  # switched between steps: the next step reads the layers as they are
        layer.saved_fp8 = False
    record = profile(model, profiler, dtype)
    assert record.impl_saved_bytes == {"drop_h": 4 * bf16}
    assert model_config(model)["mlp_impl"] == "drop_h"
