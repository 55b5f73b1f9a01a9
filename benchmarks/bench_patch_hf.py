"""A patched Hugging Face (or LitGPT) Llama against the unpatched one and Liger: step time,
after-forward and peak MiB (issue 20's H200 figures).

The model is Llama-3-8B-shaped (D 4096, F 14336, 32 heads / 8 KV heads, vocab 128256) with
few layers, bf16, SDPA, seq 4096. Variants, each its own copy of one set of weights:
  unpatched           transformers' eager LlamaMLP (or LitGPT's LLaMAMLP);
  liger               apply_liger_kernel_to_llama(swiglu=True, model=...) on that copy, only the
                      MLP patched, so the comparison is MLP against MLP (HF only; skipped where
                      liger-kernel is not installed);
  drop_h, drop_h_quack, save_factors_quack
                      swiglu_train.patch(model, impl) (quack impls skipped without quack).
Every sample runs every variant once in a fresh random order (swiglu_train.bench.timing);
medians and paired ratios to unpatched are reported. The backward is of the logits with a
fixed gradient, the same for all. The after-forward figure of drop_h must be unpatched's
minus n_layers·2·M·F·2 bytes exactly (HF's eager MLP keeps gate, silu(gate), up and h; drop_h
the [M, 2F] preactivation alone); the JSON records both and the difference.

  python benchmarks/bench_patch_hf.py --layers 4 --out benchmarks/results/patch/patch_hf_h200.json
  python benchmarks/bench_patch_hf.py --library litgpt \\
      --out benchmarks/results/patch/patch_litgpt_h200.json
  python benchmarks/bench_patch_hf.py --tiny --samples 2   # a CPU smoke run of the script itself
"""

from __future__ import annotations

import argparse
import copy
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import swiglu_train
from swiglu_train.bench.timing import Case, memory_mib, paired_samples
from swiglu_train.files import write_json_atomic
from swiglu_train.ops.quack_mlp import quack_available

LLAMA3_8B = dict(hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256)
TINY = dict(hidden=64, ffn=160, heads=4, kv_heads=2, vocab=320)
OURS = ("drop_h", "drop_h_quack", "save_factors_quack")


def build(library: str, shape: dict, layers: int, seq: int, dtype: torch.dtype, device):
    """The model, initialized on ``device`` (a CPU init of the 8B-shaped layers and 128k vocab
    took most of a two-minute GPU call)."""
    torch.manual_seed(0)
    with torch.device(device):
        return _build(library, shape, layers, seq, dtype).train()


def _build(library: str, shape: dict, layers: int, seq: int, dtype: torch.dtype):
    if library == "hf":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=shape["vocab"], hidden_size=shape["hidden"],
            intermediate_size=shape["ffn"], num_hidden_layers=layers,
            num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
            max_position_embeddings=seq,
        )  # fmt: skip
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=dtype
        )
    else:
        from litgpt import GPT, Config

        config = Config(
            block_size=seq, vocab_size=shape["vocab"], padded_vocab_size=shape["vocab"],
            n_layer=layers, n_head=shape["heads"], n_query_groups=shape["kv_heads"],
            n_embd=shape["hidden"], intermediate_size=shape["ffn"], bias=False,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", rotary_percentage=1.0,
            parallel_residual=False,
        )  # fmt: skip
        model = GPT(config).to(dtype)
    return model


def variants(library: str, base: torch.nn.Module, device, tokens: int) -> dict:
    """name -> model, or name -> why it is skipped."""
    out: dict[str, torch.nn.Module | str] = {"unpatched": base}
    if library == "hf":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError:
            out["liger"] = "liger-kernel is not installed"
        else:
            liger = copy.deepcopy(base)
            apply_liger_kernel_to_llama(
                rope=False, rms_norm=False, cross_entropy=False,
                fused_linear_cross_entropy=False, swiglu=True, model=liger,
            )  # fmt: skip
            out["liger"] = liger
    for impl in OURS:
        if "quack" in impl and not (device.type == "cuda" and quack_available()):
            out[impl] = "quack is not available here"
            continue
        model = copy.deepcopy(base)
        report = swiglu_train.patch(model, impl, tokens_hint=tokens)
        if report.left or not report.replaced:
            raise RuntimeError(f"patch left MLPs of the benchmark model:\n{report}")
        out[impl] = model
    return out


def case(name: str, model, ids: torch.Tensor, grad: torch.Tensor) -> Case:
    def forward():
        out = model(ids)
        return getattr(out, "logits", out)

    return Case(
        name,
        forward,
        lambda logits: logits.backward(grad),
        lambda: model.zero_grad(set_to_none=True),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--library", choices=("hf", "litgpt"), default="hf")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--tiny", action="store_true", help="tiny shape on CPU: a smoke run")
    p.add_argument("--out", type=Path, help="JSON to write (a .md table goes beside it)")
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type != "cuda" and not args.tiny:
        sys.exit("needs CUDA (or --tiny for a CPU smoke run)")
    shape = TINY if args.tiny else LLAMA3_8B
    seq = 32 if args.tiny else args.seq
    dtype = torch.float32 if args.tiny else torch.bfloat16
    tokens = args.batch * seq
    print(f"building {args.library} Llama, {args.layers} layers on {device}", flush=True)
    base = build(args.library, shape, args.layers, seq, dtype, device)
    models = variants(args.library, base, device, tokens)
    print(f"variants: {', '.join(models)}; warming up", flush=True)
    live = {n: m for n, m in models.items() if not isinstance(m, str)}
    ids = torch.randint(0, shape["vocab"], (args.batch, seq), device=device)
    grad = torch.randn(args.batch, seq, shape["vocab"], device=device, dtype=dtype)
    grad /= grad.numel() ** 0.5
    with torch.no_grad():  # every variant computes the unpatched function
        want = case("ref", base, ids, grad).forward().float()
        for name, model in live.items():
            got = case(name, model, ids, grad).forward().float()
            err = ((got - want).norm() / want.norm()).item()
            if err > (1e-5 if dtype == torch.float32 else 2e-2):
                raise RuntimeError(f"{name} logits differ from unpatched by {err:.2e}")
    cases = [case(n, m, ids, grad) for n, m in live.items()]
    for c in cases:  # warm-up: compilation and autotuning out of the timed samples
        memory_mib(c, device)
    memory = {c.name: memory_mib(c, device) for c in cases}
    times = paired_samples(cases, args.samples, device)
    full = {n: t["full"] for n, t in times.items()}
    result = {
        "library": args.library, "layers": args.layers, "seq": seq, "batch": args.batch,
        "shape": shape, "dtype": str(dtype), "samples": args.samples,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "commit": _commit(),
        "skipped": {n: m for n, m in models.items() if isinstance(m, str)},
        "variants": {
            n: {
                "median_ms": float(np.median(full[n])),
                "ratio_to_unpatched": float(np.median(full[n] / full["unpatched"])),
                "after_forward_MiB": memory[n][0],
                "peak_MiB": memory[n][1],
            }
            for n in live
        },
    }  # fmt: skip
    expected = args.layers * 2 * tokens * shape["ffn"] * torch.finfo(dtype).bits // 8 / 2**20
    after = {n: v["after_forward_MiB"] for n, v in result["variants"].items()}
    if after.get("unpatched") is not None and after.get("drop_h") is not None:
        result["drop_h_after_forward_cut_MiB"] = {
            "measured": after["unpatched"] - after["drop_h"],
            "expected": expected,  # n_layers * 2 * M * F * itemsize
        }
    print(_table(result))
    if args.out:
        write_json_atomic(args.out, result)
        args.out.with_suffix(".md").write_text(_table(result) + "\n")


def _table(result: dict) -> str:
    lines = [
        f"{result['library']} Llama, {result['layers']} layers, seq {result['seq']}, "
        f"{result['dtype']}, {result['device']}, {result['samples']} paired samples",
        "",
        "| variant | median ms | x unpatched | after-forward MiB | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for name, v in result["variants"].items():
        mib = [("—" if x is None else f"{x:,.0f}") for x in (v["after_forward_MiB"], v["peak_MiB"])]
        lines.append(f"| {name} | {v['median_ms']:.2f} | {v['ratio_to_unpatched']:.3f} | "
                     f"{mib[0]} | {mib[1]} |")  # fmt: skip
    cut = result.get("drop_h_after_forward_cut_MiB")
    if cut:
        lines.append(f"\ndrop_h after-forward cut: {cut['measured']:.1f} MiB measured, "
                     f"{cut['expected']:.1f} MiB expected (n_layers·2·M·F·2)")  # fmt: skip
    for name, why in result["skipped"].items():
        lines.append(f"\nskipped {name}: {why}")
    return "\n".join(lines)


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parent)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


if __name__ == "__main__":
    main()
