"""The largest micro-batch that trains without running out of GPU memory, per MLP impl.

This is the user-visible win of drop_h: at the ~1B config, how many more sequences fit.

    python benchmarks/max_micro_batch.py --config 1b --mlp-impl normal,drop_h,drop_h+fp8 \\
        --json o.json

``drop_h+fp8`` is drop_h with its saved preactivation in FP8 (model.saved_fp8), named as the
planner and bench_e2e name it.

Each trial runs two real optimizer steps (bf16 autocast, AdamW, the recipe's model) on one
model per impl; the search doubles, then bisects. After an out-of-memory step the cache is
emptied; fragmentation left behind could only make a later, smaller trial fail, so the
figure is never overstated.
"""

from __future__ import annotations

import gc
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
import typer

from swiglu_train.bench.results import git_commit
from swiglu_train.files import write_json_atomic
from swiglu_train.integrations.lightning.config import load_config
from swiglu_train.integrations.lightning.model import LlamaDecoder
from swiglu_train.memory.budget import split_candidate


def largest_fitting(fits: Callable[[int], bool], limit: int) -> tuple[int, list[int]]:
    """Largest n in [1, limit] with fits(n), assuming fits is monotone; and the n tried."""
    tried, low, n = [], 0, 1
    while n <= limit:  # double until the first failure
        tried.append(n)
        if not fits(n):
            break
        low, n = n, n * 2
    high = min(n, limit + 1)  # the first n known (or assumed) not to fit
    while high - low > 1:
        mid = (low + high) // 2
        tried.append(mid)
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low, tried


def model_config(config: str, candidate: str):
    """The config's model with ``candidate``'s impl (``drop_h+fp8``: drop_h, saved_fp8)."""
    cfg = load_config(config)
    cfg.model.mlp_impl, cfg.model.saved_fp8 = split_candidate(candidate)
    return cfg


def trainer(config: str, impl: str) -> Callable[[int], bool]:
    """A trial function over one model and optimizer, built once per impl.

    Weights, grads and AdamW state do not depend on the micro-batch, so rebuilding them per
    trial only costs time (a 1B model takes seconds); each trial runs two steps at its size,
    and an out-of-memory step is caught, its activations freed, and reported as a misfit.
    """
    cfg = model_config(config, impl)
    model = LlamaDecoder(cfg.model).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def fits(micro_batch: int) -> bool:
        print(f"{impl}: trying micro-batch {micro_batch}", flush=True)  # a crash names its size
        tokens = torch.randint(0, 256, (micro_batch, cfg.data.seq_length + 1), device="cuda")
        try:
            for _ in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
                )
                del logits
                loss.backward()
                del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            print(f"{impl}: micro-batch {micro_batch} trains", flush=True)
            return True
        except torch.cuda.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            print(f"{impl}: micro-batch {micro_batch} is out of memory", flush=True)
            return False
        finally:
            del tokens
            gc.collect()
            torch.cuda.empty_cache()

    return fits


def main(
    config: Annotated[str, typer.Option()] = "1b",
    mlp_impl: Annotated[str, typer.Option()] = "normal,drop_h",
    limit: Annotated[int, typer.Option(help="largest micro-batch to try")] = 256,
    commit: Annotated[str | None, typer.Option(help="commit to record if git is absent")] = None,
    json_path: Annotated[Path | None, typer.Option("--json")] = None,
) -> None:
    """Search each impl in turn; the JSON is rewritten after each, so a run cut short (a
    time bound, a crash) keeps the impls that finished."""
    payload = {
        "command": shlex.join(["python", *sys.argv]),
        "commit": commit or git_commit(),  # the caller names the tree it ran: a copy's .git may lag
        "config": config,
        "device_name": torch.cuda.get_device_name(),
        "seq_length": load_config(config).data.seq_length,
        "results": [],
    }
    for impl in mlp_impl.split(","):
        best, tried = largest_fitting(trainer(config, impl), limit)
        gc.collect()
        torch.cuda.empty_cache()
        payload["results"].append({"impl": impl, "max_micro_batch": best, "tried": tried})
        print(f"{impl}: largest micro-batch {best} (tried {tried})")
        by_impl = {r["impl"]: r["max_micro_batch"] for r in payload["results"]}
        if by_impl.get("normal"):
            payload["ratio_to_normal"] = {k: v / by_impl["normal"] for k, v in by_impl.items()}
        if json_path is not None:
            write_json_atomic(json_path, payload)


if __name__ == "__main__":
    typer.run(main)
