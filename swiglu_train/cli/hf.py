"""Hugging Face commands: export a pretrain checkpoint's whole model, import an HF Llama or
Mixtral."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from swiglu_train.cli.app import app, check_output, console
from swiglu_train.extras import require
from swiglu_train.files import atomic_write


@app.command("export-hf")
def export_hf(
    ckpt: Annotated[
        Path,
        typer.Argument(
            help="a pretrain checkpoint (.ckpt, or a sharded one's directory), or what "
            "import-hf wrote"
        ),
    ],
    out: Annotated[
        Path, typer.Argument(help="the HF directory to write; new, or empty (written atomically)")
    ],
    trust: Annotated[bool, typer.Option(help="unpickle arbitrary objects (trusted files)")] = False,
) -> None:
    """Write the whole model as a Hugging Face LlamaForCausalLM directory (an MoE model as
    MixtralForCausalLM: config.json, model.safetensors) that transformers loads, with the same
    logits."""
    import torch

    from swiglu_train.cli.checkpoints import read_sharded
    from swiglu_train.cli.torch_files import load_error

    require("transformers", "safetensors")  # before the checkpoint is read: one line, the extra
    from swiglu_train.integrations.lightning.hf import export_hf as export

    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise typer.BadParameter(f"{out} exists and is not an empty directory", param_hint="OUT")
    check_output(out, "OUT", directory=True)
    try:
        loaded = read_sharded(ckpt, trust, "CKPT")
        if loaded is None:
            loaded = torch.load(ckpt, map_location="cpu", weights_only=not trust)
    except FileNotFoundError:
        raise typer.BadParameter(f"{ckpt} does not exist", param_hint="CKPT") from None
    except Exception as e:  # not a checkpoint, a refused pickle, an empty or damaged file
        raise typer.BadParameter(load_error(ckpt, e, trust), param_hint="CKPT") from e
    try:
        config = export(loaded, out, str(ckpt))
    except ValueError as e:  # not a pretrain checkpoint, a layout or bias HF cannot take
        raise typer.BadParameter(str(e), param_hint="CKPT") from e
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_local_experts", "num_experts_per_tok")  # fmt: skip
    shape = ", ".join(f"{k} {config[k]}" for k in keys if k in config)
    [arch] = config["architectures"]
    console.print(f"wrote {escape(str(out))}: {arch} ({shape}, {config['dtype']})")
    console.print(
        f"load it with transformers.{arch}.from_pretrained({escape(repr(str(out)))}); "
        "its token ids are the pretrain recipe's (UTF-8 bytes 0-255, end of document 256 as "
        "eos_token_id): no tokenizer is written"
    )


@app.command("import-hf")
def import_hf(
    source: Annotated[Path, typer.Argument(help="a Hugging Face Llama or Mixtral directory")],
    ckpt: Annotated[Path, typer.Argument(help="the checkpoint to write (atomically)")],
) -> None:
    """Convert a Hugging Face Llama (LlamaForCausalLM) or Mixtral (MixtralForCausalLM) into a
    pretrain checkpoint: the same logits from our decoder; start a run from it with
    `pretrain --init-from`."""
    import torch

    require("transformers", "safetensors")
    from swiglu_train.integrations.lightning.hf import import_hf as convert

    if not source.is_dir():
        raise typer.BadParameter(f"{source} is not a directory", param_hint="SOURCE")
    check_output(ckpt, "CKPT")
    try:
        converted, notes = convert(source)
    except ValueError as e:  # another architecture, or what our decoder cannot compute
        raise typer.BadParameter(str(e), param_hint="SOURCE") from e
    with atomic_write(ckpt, "wb") as f:
        torch.save(converted, f)
    model = converted["hyper_parameters"]["model"]
    keys = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads",
            *(("num_experts", "moe_top_k") if model.get("num_experts") else ()))  # fmt: skip
    shape = ", ".join(f"{k} {model[k]}" for k in keys)
    console.print(f"wrote {escape(str(ckpt))}: our decoder ({shape}), fc1 canonical")
    for note in notes:
        console.print(f"note: {escape(note)}")
    console.print(
        f"start a run from it: swiglu-train pretrain --init-from {escape(str(ckpt))} "
        "(--mlp-impl picks the impl; fc1 is packed on load where it packs)"
    )
