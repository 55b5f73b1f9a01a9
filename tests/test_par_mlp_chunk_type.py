"""A chunk given as a numpy integer (a config computed with numpy) is stamped as a plain int, so
the checkpoint loads under torch.load's default weights_only=True."""

import io

import numpy as np
import pytest
import torch

from swiglu_train import ParMLP


@pytest.mark.parametrize("chunk", [np.int64(16), np.int32(16)])
def test_a_numpy_chunk_is_stamped_as_int_and_loads_weights_only(chunk):
    mlp = ParMLP(32, 48, impl="save_factors", chunk=chunk)
    stamp = mlp.state_dict()["_extra_state"]["fc1_layout"]
    assert type(stamp["chunk"]) is int and stamp["chunk"] == 16
    buffer = io.BytesIO()
    torch.save(mlp.state_dict(), buffer)
    buffer.seek(0)
    loaded = ParMLP(32, 48, impl="drop_h")
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), mlp(x))
