"""A short bf16-mixed training run of a small decoder-like stack, profiled and logged to W&B.

Feeds ``swiglu-train compare-memory``: one W&B run per impl, in one directory, e.g.

    python benchmarks/memory_training_run.py --mlp-impl normal,drop_h --out runs
    swiglu-train compare-memory runs/wandb/offline-run-* --out docs/memory.png

The impls run one after another in one process, so Triton autotunes each shape once.

It is a plain PyTorch loop on purpose: the profiler's step API works in any loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from torch import nn

from swiglu_train import ParMLP
from swiglu_train.memory import MemoryProfiler
from swiglu_train.memory.wandb_run import WandbMemoryLogger, init_run


class Block(nn.Module):
    def __init__(self, d: int, f: int, impl: str) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.mlp = ParMLP(d, f, impl=impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, f: int, layers: int, impl: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, impl) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens[:, 1:].flatten())


def train(impl: str, out: Path, steps: int, shape: dict[str, int], project: str, group: str):
    """Train ``steps`` steps of one impl from the same seed and log each step's memory."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    vocab, batch, seq = shape["vocab"], shape["batch"], shape["seq"]
    model = TinyLM(vocab, shape["hidden"], shape["ffn"], shape["layers"], impl).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "mlp_impl": impl,
        "hidden_size": shape["hidden"],
        "ffn_hidden_size": shape["ffn"],
        "num_layers": shape["layers"],
        "micro_batch_size": batch,
        "seq_length": seq,
        "device": device,
        "precision": "bf16-mixed",
    }
    run = init_run(project, group=group, name=impl, config=config, directory=out)
    logger = WandbMemoryLogger(run)
    profiler = MemoryProfiler(model, per_layer=True)
    data = torch.randint(0, vocab, (steps, batch, seq + 1), device=device)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with profiler.step(step) as p:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(data[step])
            p.forward_done()
            loss.backward()
        optimizer.step()
        logger.log(profiler.records[-1], {"train/loss": loss.item()})
    run.finish()


def main(
    mlp_impl: Annotated[str, typer.Option(help="impls, comma-separated")] = "normal,drop_h",
    out: Annotated[Path, typer.Option(help="directory for the W&B runs")] = Path("runs"),
    steps: int = 20,
    layers: int = 4,
    hidden: int = 1024,
    ffn: int = 2816,
    batch: int = 8,
    seq: int = 1024,
    vocab: int = 8192,
    project: str = "swiglu-train-memory",
    group: str = "compare-memory",
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shape = {"layers": layers, "hidden": hidden, "ffn": ffn, "batch": batch, "seq": seq}
    for impl in mlp_impl.split(","):
        train(impl, out, steps, {**shape, "vocab": vocab}, project, group)


if __name__ == "__main__":
    typer.run(main)
