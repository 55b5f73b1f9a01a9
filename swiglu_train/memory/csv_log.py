"""A wide CSV of per-step memory metrics that spreadsheets and pandas read directly."""

from __future__ import annotations

import csv
from pathlib import Path

from swiglu_train.files import atomic_write


class MemoryCsv:
    """``step`` plus one column per metric key.

    Rows are appended; when a step brings a key the header lacks, the file is rewritten once
    through a temporary file, so it never holds a half-written header. A file already there
    (a resumed run's) keeps its rows before the first step written now: the steps from there
    on are logged again, so none is lost or doubled.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.columns: list[str] | None = None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **metrics}
        if self.columns is not None and set(row) <= set(self.columns):
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)
            return
        if self.columns is not None:
            rows = self._read()
        else:  # first write: carry over an earlier run's rows before this step
            rows = [r for r in self._earlier_rows() if int(r["step"]) < step]
        keys = {k for r in rows for k in r} | set(row)
        self.columns = ["step", *sorted(keys - {"step"})]
        self._rewrite([*rows, row])

    def _earlier_rows(self) -> list[dict[str, str]]:
        if not self.path.exists():
            return []
        with self.path.open(newline="") as f:
            if (csv.DictReader(f).fieldnames or [""])[0] != "step":
                raise ValueError(f"{self.path} exists and is not a memory CSV (no 'step' "
                                 "column); not overwriting it")  # fmt: skip
        return self._read()

    def _read(self) -> list[dict[str, str]]:
        with self.path.open(newline="") as f:
            return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]

    def _rewrite(self, rows: list[dict]) -> None:
        with atomic_write(self.path, newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)
