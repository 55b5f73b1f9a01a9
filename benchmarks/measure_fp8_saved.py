"""What storing drop_h's saved preactivation in FP8 costs in accuracy.

For each shape (M, D, F) and kind of input, bf16 x, W1, W2 and grad_y, and the relative
(Frobenius) error of y, grad_x, grad_W1 and grad_W2 against float64 math on the same values:
  bf16      ParMLP(impl="drop_h"): the preactivation saved in bf16
  fp8       ParMLP(impl="drop_h", saved_fp8=True): e4m3, one scale per row per 128 columns,
            amax / 448 rounded up to bf16
  fp8_fp32  for comparison: the same with fp32 scales, amax / 448 (the format before 2026-12)
  fp8_pow2  for comparison: the same with power-of-two scales (OCP MX's E8M0), the least that
            brings the block's max to 448 or under
  fp8_row   for comparison: e4m3 with one bf16 scale per row per half (block = F)
  e5m2      for comparison: e5m2 with the 128-column blocks and bf16 scales
  int8      for comparison: int8 with the 128-column blocks, amax / 127 rounded up to bf16,
            values rounded to nearest (8 bits of uniform steps, not e4m3's relative ones)
  save_factors        ParMLP(impl="save_factors"): the SwiGLU factors [up·silu'(gate),
            silu(gate)] and h saved in bf16
  save_factors_fp8    whether save_factors could take the option: its factors through the
            fp8 format (h stays bf16, as fc2's input), backward grad_preact = grad_h ⊙ factors
The comparison formats recompute backward by the same math as ``ops.fp8_saved.recompute``,
checked to give fp8's gradients bit for bit when given fp8's format.

Inputs: "normal" (x, grad_y ~ N(0, 1), weights scaled to unit preactivations); "outlier
features" (8 random gate and up rows of W1 x 50, so 8 columns of the preactivation are 50x
the rest, the way a few channels dominate in LLMs); "outlier tokens" (8 rows of x x 30).

On the CPU (small shapes, the torch path, every format). With ``--device cuda --grid-m M``:
the model grid's (D, F) at M tokens, the impls' own CUDA kernels (Triton, and the FP8 path's
row chunks), bf16 against fp8 only, the float64 reference on the GPU. ``--impl drop_h_quack``
measures that impl's bf16 and FP8 paths instead (its quack epilogues, the paired format).

    python benchmarks/measure_fp8_saved.py --json benchmarks/results/fp8/fp8_saved_errors_cpu.json
    python benchmarks/measure_fp8_saved.py --device cuda --grid-m 8000 --json OUT.json
    python benchmarks/measure_fp8_saved.py --device cuda --grid-m 8000 --impl drop_h_quack \
        --json OUT.json
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F

from swiglu_train import ParMLP
from swiglu_train.bench.e2e.rounds import device_name
from swiglu_train.bench.grid.models import grid_shapes
from swiglu_train.bench.results import git_commit
from swiglu_train.files import write_json_atomic
from swiglu_train.kernels.fp8_format import restore, round_up_bf16
from swiglu_train.layers.layout import CANONICAL, relayout
from swiglu_train.ops import reference
from swiglu_train.ops.activation import use_backend
from swiglu_train.ops.fp8_saved import recompute_from

SHAPES = ((512, 256, 704), (1024, 512, 1408), (768, 384, 1000))  # 1000: a partial block
KINDS = ("normal", "outlier features", "outlier tokens")
OUTPUTS = ("y", "grad_x", "grad_W1", "grad_W2")


def inputs(m: int, d: int, f: int, kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g)
    w1 = torch.randn(2 * f, d, generator=g) / d**0.5
    w2 = torch.randn(d, f, generator=g) / f**0.5
    if kind == "outlier features":
        rows = torch.randperm(2 * f, generator=g)[:8]
        w1[rows] *= 50
    elif kind == "outlier tokens":
        x[torch.randperm(m, generator=g)[:8]] *= 30
    grad_y = torch.randn(m, d, generator=g)
    return {k: v.bfloat16() for k, v in {"x": x, "w1": w1, "w2": w2, "grad_y": grad_y}.items()}


def on(t: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in t.items()}


def float64_reference(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x, w1, w2 = (t[k].double().requires_grad_() for k in ("x", "w1", "w2"))
    y = reference.mlp(x, w1, None, w2, None)
    y.backward(t["grad_y"].double())
    return {"y": y.detach(), "grad_x": x.grad, "grad_W1": w1.grad, "grad_W2": w2.grad}


def par_mlp(
    t: dict[str, torch.Tensor], saved_fp8: bool, impl: str = "drop_h"
) -> dict[str, torch.Tensor]:
    """The layer as users run it: the torch path on the CPU, the CUDA kernels on a GPU."""
    d, f, device = t["x"].shape[1], t["w2"].shape[1], t["x"].device
    mlp = ParMLP(d, f, impl=impl, saved_fp8=saved_fp8, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        mlp.fc1.weight.copy_(relayout(t["w1"], CANONICAL, mlp.fc1_layout))  # packed: its order
        mlp.fc2.weight.copy_(t["w2"])
    x = t["x"].clone().requires_grad_()
    with use_backend("torch" if device.type == "cpu" else "auto"):
        y = mlp(x)
        y.backward(t["grad_y"])
    grad_w1 = relayout(mlp.fc1.weight.grad, mlp.fc1_layout, CANONICAL)
    return {"y": y.detach(), "grad_x": x.grad, "grad_W1": grad_w1,
            "grad_W2": mlp.fc2.weight.grad}  # fmt: skip


def block_quantize(
    preact: torch.Tensor, block: int, dtype: torch.dtype, scales: str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, fp32 scale per block) in ``ops.fp8_saved.quantize``'s layout for any block and
    FP8 (or int8: rounded to nearest) dtype. ``scales``: "bf16" (amax / top rounded up to
    bf16, as shipped), "fp32" (amax / top) or "pow2" (the least power of two that brings amax
    to top or under)."""
    m, f = preact.shape[0], preact.shape[1] // 2
    integer = not dtype.is_floating_point
    nb = -(-f // block)
    top = torch.iinfo(dtype).max if integer else torch.finfo(dtype).max
    blocks = F.pad(preact.float().view(m, 2, f), (0, nb * block - f)).view(m, 2, nb, block)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(top * 2.0**-126)
    if scales == "pow2":
        _, e = torch.frexp(amax / top)  # amax / top in [2**(e-1), 2**e): the least is e or e - 1
        half = torch.ldexp(torch.full_like(amax, top), e - 1)
        scale = torch.ldexp(torch.ones_like(amax), torch.where(amax <= half, e - 1, e))
    else:
        scale = amax / torch.full_like(amax, top)
        scale = round_up_bf16(scale) if scales == "bf16" else scale
    q = (blocks * (torch.ones_like(scale) / scale)).clamp(-top, top).view(m, 2, nb * block)
    q = q.round() if integer else q
    return q[..., :f].reshape(m, 2 * f).to(dtype), scale.view(m, 2 * nb)


def round_trip(t: torch.Tensor, block: int, dtype: torch.dtype, **how) -> torch.Tensor:
    """[M, 2F] ``t`` through ``block_quantize`` and back, in fp32."""
    q, scales = block_quantize(t, block, dtype, **how)
    values = q.float().view(q.shape[0], 2, -1)
    per_column = scales.view(q.shape[0], 2, -1).repeat_interleave(block, -1)[..., : values.shape[2]]
    return restore(values, per_column).view_as(t)


def with_format(t: dict[str, torch.Tensor], block: int, dtype: torch.dtype, **how) -> dict:
    """drop_h whose saved preactivation goes through ``block_quantize``."""
    x, w1, w2, grad_y = t["x"], t["w1"], t["w2"], t["grad_y"]
    preact = F.linear(x, w1)
    y = F.linear(reference.swiglu(preact), w2)
    h, grad_preact = recompute_from(round_trip(preact, block, dtype, **how), grad_y @ w2)
    return {"y": y, "grad_x": grad_preact @ w1, "grad_W1": grad_preact.t() @ x,
            "grad_W2": grad_y.t() @ h}  # fmt: skip


def with_fp8_factors(t: dict[str, torch.Tensor]) -> dict:
    """save_factors whose saved factors go through the fp8 format (``block_quantize``, 1x128,
    bf16 scales): forward as save_factors (h and factors from the bf16 preactivation in fp32,
    stored in bf16), backward from the restored factors."""
    x, w1, w2, grad_y = t["x"], t["w1"], t["w2"], t["grad_y"]
    gate, up = F.linear(x, w1).float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    h = (gate * sig * up).to(x.dtype)
    factors = torch.cat([up * sig * (1 + gate * (1 - sig)), gate * sig], dim=-1).to(x.dtype)
    restored = round_trip(factors, 128, torch.float8_e4m3fn)
    grad_h = (grad_y @ w2).float()
    grad_preact = (restored * torch.cat([grad_h, grad_h], dim=-1)).to(x.dtype)
    return {"y": F.linear(h, w2), "grad_x": grad_preact @ w1, "grad_W1": grad_preact.t() @ x,
            "grad_W2": grad_y.t() @ h}  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def measure(shapes, kinds, seed: int, device: str = "cpu", impl: str = "drop_h") -> list[dict]:
    rows = []
    for m, d, f in shapes:
        for kind in kinds:
            t = on(inputs(m, d, f, kind, seed), device)
            ref = float64_reference(t)
            runs = {"bf16": par_mlp(t, False, impl), "fp8": par_mlp(t, True, impl)}
            if device == "cpu" and impl == "drop_h":  # the comparison formats: torch math, checked
                check = with_format(t, 128, torch.float8_e4m3fn)
                for key in OUTPUTS:  # the comparison path is fp8's own math
                    assert torch.equal(check[key], runs["fp8"][key]), key
                runs["fp8_fp32"] = with_format(t, 128, torch.float8_e4m3fn, scales="fp32")
                runs["fp8_pow2"] = with_format(t, 128, torch.float8_e4m3fn, scales="pow2")
                runs["fp8_row"] = with_format(t, f, torch.float8_e4m3fn)
                runs["e5m2"] = with_format(t, 128, torch.float8_e5m2)
                runs["int8"] = with_format(t, 128, torch.int8)
            if impl == "drop_h":
                runs["save_factors"] = par_mlp(t, False, impl="save_factors")
                runs["save_factors_fp8"] = with_fp8_factors(t)
            for name, got in runs.items():
                errors = {key: rel(got[key], ref[key]) for key in OUTPUTS}
                row = {"M": m, "D": d, "F": f, "input": kind, "impl": impl, "format": name}
                rows.append(row | errors)
                print(f"{m}x{d}x{f} {kind:16} {name:8}",
                      " ".join(f"{k} {v:.2e}" for k, v in errors.items()), flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--grid-m", type=int, help="the model grid's (D, F) at M tokens")
    parser.add_argument(
        "--impl", choices=("drop_h", "drop_h_quack"), default="drop_h",
        help="drop_h_quack: its bf16 and FP8 paths only (CUDA sm_90 with quack)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    shapes = SHAPES
    if args.grid_m is not None:
        shapes = tuple((args.grid_m, s.d, s.f) for s in grid_shapes())
    rows = measure(shapes, KINDS, args.seed, args.device, args.impl)
    if args.json:
        grid = f" --grid-m {args.grid_m}" if args.grid_m is not None else ""
        command = (f"python benchmarks/measure_fp8_saved.py --device {args.device}{grid} "
                   f"--impl {args.impl} --seed {args.seed} --json {args.json}")  # fmt: skip
        about = {"command": command, "commit": git_commit(), "torch": torch.__version__,
                 "machine": platform.machine(), "device": device_name()}  # fmt: skip
        write_json_atomic(args.json, {**about, "seed": args.seed, "rows": rows})


if __name__ == "__main__":
    main()
