"""The gated GEMM's pinned tiles: the table's checks, its lookup, and the pinned launch."""

import re
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import device_backends

from swiglu_train.ops import reference

gated_gemm = pytest.importorskip("swiglu_train.kernels.gated_gemm")
gated_tiles = pytest.importorskip("swiglu_train.kernels.gated_tiles")
TRITON = [p for p in device_backends() if p.values[1] == "triton"]


def _tile(bm=16, bn=32, bk=16, stages=2, warps=4, persistent=False, **extra) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_stages": stages,
            "num_warps": warps, "PERSISTENT": persistent, **extra}  # fmt: skip


def _table(shapes: dict) -> dict:
    return {"schema": 1, "gpu": "test", "commit": "test", "command": "test", "shapes": shapes}


def test_packaged_table_validates():
    assert isinstance(gated_tiles.packaged_table(), dict)


def test_stages_need_not_be_a_power_of_two():
    table = gated_tiles.from_dict(_table({"64x96": {"1": _tile(stages=3)}}))
    assert table[64, 96][0][1]["num_stages"] == 3


def test_lookup_takes_the_smallest_measured_m_at_or_above_and_the_exact_shape():
    one, sixteen = _tile(bn=64), _tile(bn=32, over_gemm_only=1.01)
    with gated_tiles.use_tiles(_table({"64x96": {"16": sixteen, "1": one}})):
        assert gated_tiles.pinned_tile(64, 96, 1)["BLOCK_N"] == 64
        assert gated_tiles.pinned_tile(64, 96, 2)["BLOCK_N"] == 32
        assert gated_tiles.pinned_tile(64, 96, 16)["BLOCK_N"] == 32
        assert gated_tiles.pinned_tile(64, 96, 17) is None  # past the largest measured M
        assert gated_tiles.pinned_tile(64, 128, 1) is None  # a shape never measured
        assert gated_tiles.pinned_tile(96, 64, 1) is None  # K and F are different axes


def test_overlapping_use_tiles_in_two_threads_keep_their_own_tables():
    """Thread a enters, b enters, a exits, b exits: b keeps its table throughout, and no table
    stays in force after both exit (a module global restored a's table on b's exit)."""
    a_in, a_out = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_a() -> None:
        with gated_tiles.use_tiles(_table({"64x96": {"1": _tile(bn=64)}})):
            a_in.set()
            assert b_in.wait(5)
        a_out.set()

    def thread_b() -> None:
        assert a_in.wait(5)
        with gated_tiles.use_tiles(_table({"64x96": {"1": _tile(bn=32)}})):
            b_in.set()
            assert a_out.wait(5)
            seen["b"] = gated_tiles.pinned_tile(64, 96, 1)

    b_in = threading.Event()
    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["b"] is not None and seen["b"]["BLOCK_N"] == 32
    assert gated_tiles.pinned_tile(64, 96, 1) is None  # the packaged table has no 64x96
    after = {}
    thread = threading.Thread(target=lambda: after.update(t=gated_tiles.pinned_tile(64, 96, 1)))
    thread.start()
    thread.join(10)
    assert after == {"t": None}


@pytest.mark.parametrize(
    ("shapes", "where"),
    [
        ({"64x96": {"016": _tile()}}, "shapes.64x96.016"),
        ({"64x96": {"1": _tile(bn=48)}}, "shapes.64x96.1"),
        ({"64x96": {"1": _tile(bn=8)}}, "shapes.64x96.1"),
        ({"64x96": {"1": _tile(bk=8)}}, "shapes.64x96.1"),  # below tl.dot's K on sm_90
        ({"64x96": {1: _tile()}}, "shapes.64x96.1"),  # a dict passed to use_tiles
        ({(64, 96): {"1": _tile()}}, "shapes.(64, 96)"),
        ({"64x96": {"1": _tile(over_gemm_only=1.0, note="x")}}, "shapes.64x96.1"),
        ({"64x96": {"1": [16, 32, 16, 2, 4, False]}}, "shapes.64x96.1"),
        ({"64x96": [_tile()]}, "shapes.64x96"),
        ({"64x96": {"1": _tile(persistent=1)}}, "shapes.64x96.1"),
        ({"64x96": {"1": _tile(stages=0)}}, "shapes.64x96.1"),
        ({"64x96": {"1": _tile(warps=3)}}, "shapes.64x96.1"),
        ({"64x96": {"1": _tile(GROUP_M=4)}}, "shapes.64x96.1"),
        ({"64x96": {"1": {"BLOCK_M": 16}}}, "shapes.64x96.1"),
        ({"64x96": {}}, "shapes.64x96"),
        ({"64*96": {"1": _tile()}}, "shapes.64*96"),
    ],
)
def test_a_bad_table_is_refused_naming_the_spot(shapes, where):
    with pytest.raises(gated_tiles.GatedTilesError, match=re.escape(f"<table>: {where}: expected")):
        gated_tiles.from_dict(_table(shapes))


@pytest.mark.parametrize(("schema", "shown"), [(2, "2"), (True, "True"), (1.0, "1.0")])
def test_a_table_of_another_schema_is_refused(schema, shown):
    with pytest.raises(gated_tiles.GatedTilesError, match=f"schema: expected 1, got {shown}"):
        gated_tiles.from_dict(_table({}) | {"schema": schema})


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_a_pinned_tile_is_launched_and_gives_the_same_h(device, backend, monkeypatch):
    """The measured call (canonical fc1, no aux, no bias, 16-bit) launches the table's tile, whose h
    is the autotuned launch's (up to the bf16 rounding of another K split); other calls at
    that shape still autotune."""
    m, k, f = 5, 32, 64
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(2 * f, k, device=device) / k**0.5).to(torch.bfloat16)
    autotuned, _ = gated_gemm.gated_gemm(x, w, None, chunk=f)
    launched = []
    real = gated_gemm.set_block_shapes
    monkeypatch.setattr(
        gated_gemm, "set_block_shapes", lambda nargs: (launched.append(nargs), real(nargs))
    )
    with gated_tiles.use_tiles(_table({f"{k}x{f}": {"16": _tile(bn=32, bk=16)}})):
        h, _ = gated_gemm.gated_gemm(x, w, None, chunk=f)
        assert [(n["BLOCK_M"], n["BLOCK_N"], n["BLOCK_K"]) for n in launched] == [(16, 32, 16)]
        gated_gemm.gated_gemm(x, w, None, chunk=f, aux="preact")  # the training forward
        gated_gemm.gated_gemm(x.float(), w.float(), None, chunk=f)  # fp32: not measured
        gated_gemm.gated_gemm(x, w, None, chunk=16)  # packed fc1: not measured
        bias = torch.zeros(2 * f, device=device, dtype=x.dtype)
        gated_gemm.gated_gemm(x, w, bias, chunk=f)  # a bias: another kernel, not measured
        if device == "cuda":  # x 2 bytes off TMA's 16-byte alignment: the pointer path
            off = torch.empty(m * k + 1, device=device, dtype=x.dtype)[1:].view(m, k).copy_(x)
            gated_gemm.gated_gemm(off, w, None, chunk=f)
    assert len(launched) == 1
    torch.testing.assert_close(h, autotuned, rtol=1.6e-2, atol=1e-2)
    expected = reference.swiglu(F.linear(x.float(), w.float()))
    torch.testing.assert_close(h.float(), expected, rtol=2e-2, atol=2e-2)
