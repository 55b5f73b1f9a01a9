"""The gated GEMM's tile rule: its picks launch, follow the SM count as it claims, and the
pinned launch; the lab script that judges the rule on a sweep."""

import importlib.util
import itertools
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import device_backends

from swiglu_train.ops import reference

gated_gemm = pytest.importorskip("swiglu_train.kernels.gated_gemm")
gated_tiles = pytest.importorskip("swiglu_train.kernels.gated_tiles")
from swiglu_train.kernels.gated_autotune import SHARED_MEMORY_BYTES  # noqa: E402

TRITON = [p for p in device_backends() if p.values[1] == "triton"]
ROOT = Path(__file__).resolve().parents[1]
QWEN = [(896, 4864), (2048, 11008), (3584, 18944), (5120, 27648), (8192, 29568)]


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@pytest.mark.parametrize(("k", "f"), [*QWEN, (32, 64), (100, 300), (4096, 14336)])
@pytest.mark.parametrize("sms", [16, 78, 114, 132, 170])
def test_every_pick_is_a_tile_the_kernel_launches(k, f, sms):
    for m in range(1, gated_tiles.RULE_MAX_M + 1):
        t = gated_tiles.RULE.tile(m, k, f, sms)
        blocks = [t["BLOCK_M"], t["BLOCK_N"], t["BLOCK_K"], t["num_warps"]]
        assert all(_pow2(v) for v in blocks), t
        assert t["BLOCK_N"] >= 16 and t["BLOCK_K"] >= 16 and t["num_stages"] >= 2
        assert t["BLOCK_K"] <= max(16, 1 << (k - 1).bit_length())  # no deeper than K
        smem = t["num_stages"] * (t["BLOCK_M"] + 2 * t["BLOCK_N"]) * t["BLOCK_K"] * 2
        assert smem <= SHARED_MEMORY_BYTES, t
        assert t["BLOCK_M"] >= min(m, 64) or (t["BLOCK_M"] == 16 and m <= 16)


def test_past_the_judged_m_the_autotuner_decides():
    assert gated_tiles.RULE.tile(gated_tiles.RULE_MAX_M + 1, 4096, 14336, 132) is None
    assert gated_tiles.RULE.tile(0, 4096, 14336, 132) is None


def test_decode_keeps_every_program_resident_in_one_wave_where_it_can():
    """16 x 32 programs: ceil(F / 32). The deepest pipeline (to 4 stages) that still holds
    them all in one wave, so fewer SMs mean shallower stages, and 2 stages past that."""
    rule = gated_tiles.RULE
    f = 4864  # 152 programs
    for sms in (40, 76, 132, 200):
        t = rule.tile(1, 896, f, sms)
        slots = sms * gated_tiles.resident(t, 2)
        deeper = t | {"num_stages": t["num_stages"] + 1}
        if t["num_stages"] < rule.stream_stages:
            assert sms * gated_tiles.resident(deeper, 2) < 152  # one stage more: two waves
        if t["num_stages"] > 2:
            assert slots >= 152
    stages = [rule.tile(1, 896, f, sms)["num_stages"] for sms in (40, 76, 132, 200)]
    assert stages == sorted(stages) and stages[0] < stages[-1]


def test_fewer_sms_stop_choosing_the_tile_that_spills_into_a_second_wave():
    """At M = 128, F = 27648 the 128 x 128 tile makes 216 programs, one per SM: on 132 SMs
    they fill 1.64 of 2 waves and the tile is chosen; on 200 SMs they leave 184 of 400 slots
    idle in the second wave, so a smaller tile that fills better wins."""
    rule = gated_tiles.RULE
    for sms in (100, 120, 132, 180, 200, 216, 300):
        t = rule.tile(128, 5120, 27648, sms)
        big = t | {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 4, "num_warps": 8}
        if gated_tiles.wave_fill(big, 128, 27648, sms, 2) >= rule.min_fill:
            assert (t["BLOCK_M"], t["BLOCK_N"]) == (128, 128), sms
        else:
            assert t["BLOCK_M"] * t["BLOCK_N"] < 128 * 128, sms
            assert gated_tiles.wave_fill(t, 128, 27648, sms, 2) >= rule.min_fill, sms
    assert rule.tile(128, 5120, 27648, 132)["BLOCK_M"] == 128
    assert rule.tile(128, 5120, 27648, 200)["BLOCK_M"] == 64  # 432 programs: 0.72 of 3 waves


def test_a_small_f_takes_more_smaller_tiles():
    """0.5B at M = 128: 128-row tiles give 38 or 76 programs on 132 SMs; 64 x 32 gives 304."""
    t = gated_tiles.RULE.tile(128, 896, 4864, 132)
    assert (t["BLOCK_M"], t["BLOCK_N"], t["num_stages"], t["num_warps"]) == (64, 32, 4, 4)


def test_a_second_program_per_sm_is_bought_with_a_stage():
    """128 x 64 at 4 stages takes 128 KiB (one per SM); at 3, 96 KiB (two)."""
    deep = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 4, "num_warps": 8}
    assert gated_tiles.resident(deep, 2) == 1
    assert gated_tiles.resident(deep | {"num_stages": 3}, 2) == 2
    picks = {(t["BLOCK_M"], t["BLOCK_N"]): t["num_stages"]
             for k, f in QWEN for m in (64, 128)
             for t in [gated_tiles.RULE.tile(m, k, f, 132)]}  # fmt: skip
    assert all(s == (3 if bm_bn == (128, 64) else 4) for bm_bn, s in picks.items())


def test_lookup_is_cached_and_autotune_only_is_per_thread():
    gated_tiles.rule_tile.cache_clear()
    gated_tiles.rule_tile(1, 896, 4864, 132)
    gated_tiles.rule_tile(1, 896, 4864, 132)
    assert gated_tiles.rule_tile.cache_info().hits == 1
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    seen = {}
    inside, checked = threading.Event(), threading.Event()

    def other() -> None:
        assert inside.wait(5)
        seen["other"] = gated_tiles.pinned_config(x, 64, 64, "none", has_bias=False, use_tma=False)
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with gated_tiles.autotune_only():
        inside.set()
        assert checked.wait(5)
        assert gated_tiles.pinned_config(x, 64, 64, "none", has_bias=False, use_tma=False) is None
    thread.join(10)
    if gated_tiles.INTERPRET:  # the interpreter stands in for sm_90: the rule pins there
        assert seen["other"] is not None


@pytest.mark.parametrize(("device", "backend"), TRITON)
def test_the_rule_tile_is_launched_and_gives_the_same_h(device, backend, monkeypatch):
    """The measured call (canonical fc1, no aux, no bias, 16-bit) launches the rule's tile, whose
    h is the autotuned launch's (up to the bf16 rounding of another K split); other calls at
    that shape still autotune."""
    m, k, f = 5, 32, 64
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(2 * f, k, device=device) / k**0.5).to(torch.bfloat16)
    with gated_tiles.autotune_only():
        autotuned, _ = gated_gemm.gated_gemm(x, w, None, chunk=f)
    launched = []
    real = gated_gemm.set_block_shapes
    monkeypatch.setattr(
        gated_gemm, "set_block_shapes", lambda nargs: (launched.append(nargs), real(nargs))
    )
    sms = gated_tiles.num_sms(x.device.index or 0 if x.is_cuda else 0)
    want = gated_tiles.RULE.tile(m, k, f, sms)
    h, _ = gated_gemm.gated_gemm(x, w, None, chunk=f)
    assert [(n["BLOCK_M"], n["BLOCK_N"], n["BLOCK_K"]) for n in launched] == [
        (want["BLOCK_M"], want["BLOCK_N"], want["BLOCK_K"])
    ]
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


def _fit_script():
    spec = importlib.util.spec_from_file_location(
        "fit_gated_tile_rule", ROOT / "benchmarks" / "fit_gated_tile_rule.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _synthetic_sweep(sms: int) -> dict:
    """Two shapes at M 1 and 128 where a config's time is 1 + its distance from the shipped
    rule's pick in stages and tile size, so the rule's picks are the best, plus a decoy the
    autotuner 'picked' at 1.5x; and one point whose rule pick was never timed."""
    fit = _fit_script()
    rows = []
    for (k, f), m in itertools.product([(896, 4864), (5120, 27648)], (1, 128)):
        pick = gated_tiles.RULE.tile(m, k, f, sms)
        others = [
            pick | {"num_stages": pick["num_stages"] + 1},
            pick | {"BLOCK_N": pick["BLOCK_N"] // 2},
        ]
        times = {fit.label(pick): 1.0} | {fit.label(t): 1.1 + 0.1 * i for i, t in enumerate(others)}
        times["decoy"] = 1.5
        times["autotuned"] = 1.5
        rows.append({"M": m, "K": k, "F": f, "over_gemm_only": times, "autotuned": "decoy"})
    rows.append({"M": 16, "K": 896, "F": 4864, "autotuned": "x",
                 "over_gemm_only": {"16x64x128s9w4": 1.0, "autotuned": 1.2}})  # fmt: skip
    return {"gpu": "synthetic", "commit": "test", "command": "test", "rows": rows}


def test_the_fit_script_reports_leave_one_shape_out_on_a_synthetic_sweep(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_synthetic_sweep(132)))
    out, md = tmp_path / "rule.json", tmp_path / "rule.md"
    argv = [
        "fit",
        "--sweep",
        str(sweep),
        "--judge",
        str(sweep),
        "--json",
        str(out),
        "--md",
        str(md),
    ]
    fit = _fit_script()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", argv)
        fit.main()
    result = json.loads(out.read_text())
    rows = {(r["M"], r["K"], r["F"]): r["over_gemm_only"] for r in _synthetic_sweep(132)["rows"]}
    loso = result["leave_one_shape_out"]
    assert len(loso["rows"]) == 5 and result["sms"] == 132
    for r in loso["rows"]:  # each shape's pick, by the rule fitted without it, as timed
        assert set(r["rule"]) == {"min_fill", "stream_n", "stream_stages"}
        times = rows[r["M"], r["K"], r["F"]]
        best = min(v for n, v in times.items() if n != "autotuned")
        assert r["timed"] == (r["pick"] in times)  # an untimed pick is flagged, not guessed
        if r["timed"]:
            assert r["pick_over_best"] == pytest.approx(times[r["pick"]] / best, abs=1e-4)
            assert r["pick_over_autotuned"] == pytest.approx(times[r["pick"]] / 1.5, abs=1e-3)
        else:
            assert r["pick_over_best"] is None and r["pick_over_autotuned"] is None
    assert loso["summary"]["untimed_picks"] == sum(not r["timed"] for r in loso["rows"]) >= 1
    shipped = result["shipped_in_sample"]  # the synthetic best is the shipped rule's pick
    assert shipped["untimed_picks"] == 1 and shipped["within_2pct"] == 4
    assert shipped["max_over_best"] == 1.0 and shipped["median_over_autotuned"] < 0.67
    judged = result["judged"][0]
    configs = sum(len(t) - 1 for t in rows.values())  # the sweep judged against itself
    assert judged["summary"]["rerun_spread"] == {"configs": configs, "median": 0.0, "max": 0.0}
    assert "leave one shape out" in md.read_text()
