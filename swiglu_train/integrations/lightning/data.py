"""Pretraining data that never downloads: byte-level tokens from local text, packed to length.

The default corpus is the running Python's own standard library sources: real, varied text
that every machine has. ``--data`` also takes text files or globs, ``.jsonl`` files (a
``text`` field per line) and Megatron indexed datasets (a ``.bin``/``.idx`` prefix).
"""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Sampler

from swiglu_train.extras import MissingExtra

EOD = 256  # end-of-document id, after the 256 byte values


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus an end-of-document id."""

    vocab_size = 257
    eod = EOD

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass
class DataConfig:
    data: list[str] | None = None  # None: the standard library's sources
    seq_length: int = 128
    micro_batch_size: int = 16
    val_fraction: float = 0.01
    val_batches: int = 4
    seed: int = 1234


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def load_documents(sources: list[str] | None) -> list[tuple[str, np.ndarray]]:
    """(name, token ids) per document, in a deterministic order."""
    tokenizer = ByteTokenizer()
    if not sources:
        return [(str(p), tokenizer.encode(_read(p))) for p in stdlib_files()]
    documents = []
    for source in sources:
        if Path(f"{source}.idx").exists() and Path(f"{source}.bin").exists():
            documents += _megatron_documents(source)
            continue
        paths = sorted(glob.glob(source, recursive=True)) or [source]
        for path in map(Path, paths):
            if not path.is_file():
                raise FileNotFoundError(
                    f"--data {source!r}: no such file, glob match or "
                    f"Megatron .bin/.idx prefix ({path})"
                )
            if path.suffix == ".jsonl":
                documents += _jsonl_documents(path, tokenizer)
            else:
                documents.append((str(path), tokenizer.encode(_read(path))))
    return documents


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def _jsonl_documents(path: Path, tokenizer: ByteTokenizer) -> list[tuple[str, np.ndarray]]:
    documents = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "text" not in record:
                raise ValueError(f"{path}:{number}: a jsonl record needs a 'text' field")
            documents.append((f"{path}:{number}", tokenizer.encode(record["text"])))
    return documents


def _megatron_documents(prefix: str) -> list[tuple[str, np.ndarray]]:
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError as e:
        raise MissingExtra(f"--data {prefix!r} is a Megatron indexed dataset, which "
                           "megatron-core reads", "megatron") from e  # fmt: skip
    dataset = IndexedDataset(prefix)
    # Copies: the items are views of a memory map that closes with the dataset.
    return [(f"{prefix}#{i}", np.array(dataset[i], dtype=np.int32)) for i in range(len(dataset))]


def pack(documents: list[np.ndarray], seq_length: int) -> torch.Tensor:
    """Concatenate documents with end-of-document ids; cut into [N, seq_length + 1] rows
    (inputs and shifted targets share a row; rows overlap by one token). Rows are int32, a
    quarter of int64's memory for a corpus the size of the standard library."""
    stream = np.concatenate([np.append(d, EOD) for d in documents]) if documents else []
    rows = (len(stream) - 1) // seq_length
    if rows < 1:
        return torch.empty(0, seq_length + 1, dtype=torch.int32)
    index = np.arange(rows)[:, None] * seq_length + np.arange(seq_length + 1)
    return torch.from_numpy(np.asarray(stream)[index].astype(np.int32))


def val_stride(val_fraction: float) -> int | None:
    """Every how many documents one is held out for validation (None: none is)."""
    return max(2, round(1 / val_fraction)) if val_fraction > 0 else None


def split(
    documents: list[tuple[str, np.ndarray]], val_fraction: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Deterministic document-level split: every k-th document (k = 1 / val_fraction) of the
    sorted corpus is held out, wherever the corpus lives."""
    stride = val_stride(val_fraction)
    if stride is None:
        return [ids for _, ids in documents], []
    train = [ids for i, (_, ids) in enumerate(documents) if i % stride != stride - 1]
    val = [ids for i, (_, ids) in enumerate(documents) if i % stride == stride - 1]
    return train, val


class StepSampler(Sampler[list[int]]):
    """Batches of row indices from a seeded permutation per epoch, starting at a given batch.

    Batch ``k`` of rank ``r`` is global batch ``k * world + r``, so ranks never share rows, and
    resuming at ``start_batch`` yields exactly the batches an uninterrupted run would have.
    """

    def __init__(
        self,
        rows: int,
        batch_size: int,
        seed: int,
        start_batch: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.start_batch, self.rank, self.world = start_batch, rank, world

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.rows // self.batch_size
        batch = self.start_batch
        while True:
            epoch, offset = divmod(batch * self.world + self.rank, per_epoch)
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.rows, generator=generator)
            yield order[offset * self.batch_size : (offset + 1) * self.batch_size].tolist()
            batch += 1

    def __len__(self) -> int:
        return 2**62  # unbounded: training length is set by max_steps


class StepLoader(DataLoader):
    """The training loader: a StepSampler's batches, and its position through Lightning's
    stateful-loader protocol (``state_dict`` / ``load_state_dict``), which Lightning saves in
    each checkpoint and restores on resume. Without it Lightning warns that a mid-epoch resume
    (every resume here: the run is one endless epoch) may draw other batches.

    The position saved is ``done()``, the micro-batches the trainer has trained on, not the
    sampler's count: Lightning's fetcher draws a batch ahead of the one being trained on.
    """

    def __init__(self, rows: Dataset, sampler: StepSampler, done: Callable[[], int]) -> None:
        super().__init__(rows, batch_sampler=sampler)
        self._done = done

    def state_dict(self) -> dict[str, int]:
        return {"next_batch": self._done()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batch_sampler.start_batch = state["next_batch"]


class Rows(Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index].long()


class PackedTextData(pl.LightningDataModule):
    def __init__(self, cfg: DataConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.train_rows = self.val_rows = None
        self.corpus_tokens: int | None = None  # the whole corpus's, a cheap identity of it

    def setup(self, stage: str) -> None:
        if self.train_rows is not None:
            return
        documents = load_documents(self.cfg.data)
        self.corpus_tokens = sum(len(ids) for _, ids in documents)
        train, val = split(documents, self.cfg.val_fraction)
        self.train_rows = pack(train, self.cfg.seq_length)
        self.val_rows = pack(val, self.cfg.seq_length)[
            : self.cfg.val_batches * self.cfg.micro_batch_size
        ]
        what = self.cfg.data or "the Python standard library"
        if len(self.train_rows) < self.cfg.micro_batch_size:
            raise ValueError(
                f"corpus {what} is too small: {len(self.train_rows)} training rows of "
                f"{self.cfg.seq_length + 1} tokens, need at least {self.cfg.micro_batch_size}"
            )
        wanted = self.cfg.val_fraction > 0 and self.cfg.val_batches > 0
        if wanted and not self.has_validation:  # asked for, but the corpus gives none
            stride = val_stride(self.cfg.val_fraction)
            why = (
                f"corpus {what} has fewer than {stride} documents, one in {stride} held out"
                if not val
                else f"its {len(val)} held-out documents fill no row of "
                f"{self.cfg.seq_length + 1} tokens"
            )
            rank_zero_warn(f"no validation set: {why}; val_loss is not computed")
        largest = int(self.train_rows.max())
        if largest >= self.vocab_size:
            raise ValueError(
                f"corpus {what} has token id {largest} >= vocab_size {self.vocab_size}"
            )

    def train_dataloader(self) -> StepLoader:
        trainer = self.trainer

        def done() -> int:  # checkpoints are saved at optimizer steps
            return trainer.global_step * trainer.accumulate_grad_batches

        # Lightning restores the loop state before it builds the loaders and the loader's own
        # state after: a checkpoint that records no loader state (written before StepLoader)
        # resumes at the same batch from the restored step.
        sampler = StepSampler(
            len(self.train_rows),
            self.cfg.micro_batch_size,
            self.cfg.seed,
            start_batch=done(),
            rank=trainer.global_rank,
            world=trainer.world_size,
        )
        return StepLoader(Rows(self.train_rows), sampler, done)

    @property
    def has_validation(self) -> bool:
        return len(self.val_rows) > 0

    def val_dataloader(self) -> DataLoader | list:
        if not self.has_validation:  # [] tells Lightning there is no validation to run
            return []
        return DataLoader(Rows(self.val_rows), batch_size=self.cfg.micro_batch_size)
