"""Load a training run's per-step memory metrics from a W&B run or from its ``memory.csv``.

W&B runs are read through ``wandb leet inspect --json``, which decodes the run's ``.wandb``
transaction log locally: no network, no account, and online runs read the same as offline ones.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swiglu_train.extras import missing_extra_line

STEP_KEYS = ("memory/step", "trainer/global_step", "_step")  # preferred step axis first
MAIN_KEYS = tuple(
    f"memory/{k}_MiB"
    for k in ("saved", "after_forward", "forward_peak", "backward_peak", "peak", "allocated")
)
DEPTH_FIELDS = ("allocated_MiB", "cumulative_saved_MiB")  # allocator figures win where present
_LAYER_KEY = re.compile(r"memory/layer/(\d+)/(.+)")


@dataclass
class MemoryRun:
    """One run's memory series: ``series[key][i]`` was logged at ``steps[i]`` (None: not then)."""

    label: str
    config: dict[str, Any]
    steps: list[int]
    series: dict[str, list[float | None]]
    run_id: str | None = None
    name: str | None = None
    step_key: str = "step"  # the logged key the steps come from
    start_time: str | None = None  # a W&B run's, ISO 8601: orders a resumed run's segments
    source: Path | None = None  # the file read

    @property
    def impl(self) -> str | None:
        return self.config.get("mlp_impl")

    def has(self, key: str) -> bool:
        return any(v is not None for v in self.series.get(key, ()))

    def last(self, key: str) -> float | None:
        """Latest logged value: CUDA-only keys may be logged on fewer steps than the rest."""
        return next((v for v in reversed(self.series.get(key, [])) if v is not None), None)

    def layers(self, field: str) -> list[int]:
        """Indices of the layers that logged ``memory/layer/<i>/<field>``, in depth order."""
        found = (_LAYER_KEY.fullmatch(k) for k in self.series if self.has(k))
        return sorted(int(m[1]) for m in found if m and m[2] == field)


def layer_key(index: int, field: str) -> str:
    return f"memory/layer/{index}/{field}"


def load_run(path: str | Path, label: str | None = None) -> MemoryRun:
    """Read a W&B run directory, its ``.wandb`` file, or a ``memory.csv``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"run not found: {path}")
    run = _load_csv(path) if path.suffix == ".csv" else _load_wandb(_wandb_file(path))
    run.source = run.source.resolve()
    if label:
        run.label = label
    return run


def parse_spec(spec: str | Path) -> tuple[str | None, Path]:
    """``PATH`` or ``LABEL=PATH`` (an existing path containing '=' stays a path)."""
    text = str(spec)
    label, sep, rest = text.partition("=")
    if sep and label and not Path(text).exists():
        return label, Path(rest)
    return None, Path(text)


def load_runs(specs: Iterable[str | Path]) -> list[MemoryRun]:
    """Load each spec; the segments of a resumed W&B run (run directories of one run id, one
    per resume offline) join into one run; runs that would share an impl label get their run
    name appended."""
    loaded = []
    for spec in specs:
        label, path = parse_spec(spec)
        loaded.append((load_run(path, label), label is not None))
    loaded = _join_resumed(loaded)
    named = Counter(run.label for run, explicit in loaded if explicit)
    twice = sorted(label for label, n in named.items() if n > 1)
    if twice:
        raise ValueError(f"LABEL=PATH names {twice} more than once; give each run its own label")
    counts = Counter(run.label for run, explicit in loaded if not explicit)
    for run, explicit in loaded:
        if not explicit and counts[run.label] > 1 and run.name:
            run.label = f"{run.label} ({run.name})"
    return [run for run, _ in loaded]


def _join_resumed(loaded: list[tuple[MemoryRun, bool]]) -> list[tuple[MemoryRun, bool]]:
    """Each run id read from more than one file becomes one run, where its first segment was
    listed (the same file listed twice stays two runs, as any run listed twice does)."""
    files: dict[str, set[Path]] = {}
    for run, _ in loaded:
        if run.run_id:
            files.setdefault(run.run_id, set()).add(run.source)
    joined, done = [], set()
    for run, explicit in loaded:
        if not run.run_id or len(files[run.run_id]) == 1:
            joined.append((run, explicit))
        elif run.run_id not in done:
            done.add(run.run_id)
            group = [(r, e) for r, e in loaded if r.run_id == run.run_id]
            labels = sorted({r.label for r, e in group if e})
            if len(labels) > 1:
                raise ValueError(
                    f"{labels} label segments of one resumed W&B run ({run.run_id}); label it once"
                )
            segments = list({r.source: r for r, _ in group}.values())
            merged = join_segments(segments)
            merged.label = labels[0] if labels else merged.label
            joined.append((merged, bool(labels)))
    return joined


def join_segments(segments: list[MemoryRun]) -> MemoryRun:
    """One series from the segments of a resumed run, oldest first by start time: each
    replaces the steps from its first one on (the resumed run logged them again)."""
    segments = sorted(segments, key=lambda r: (r.start_time or "", str(r.source)))
    keys = {r.step_key for r in segments}
    if len(keys) > 1:
        raise ValueError(
            f"the segments of W&B run {segments[0].run_id} count steps by different keys "
            f"({', '.join(sorted(keys))}); pass them apart"
        )
    rows: dict[int, dict[str, float | None]] = {}
    config: dict[str, Any] = {}
    for run in segments:
        rows = {step: row for step, row in rows.items() if step < run.steps[0]}
        for i, step in enumerate(run.steps):
            rows[step] = {key: values[i] for key, values in run.series.items()}
        config.update(run.config)
    steps = sorted(rows)
    names = sorted({k for run in segments for k in run.series})
    last = segments[-1]
    return MemoryRun(
        label=config.get("mlp_impl") or last.label,
        config=config,
        steps=steps,
        series={k: [rows[s].get(k) for s in steps] for k in names},
        run_id=last.run_id,
        name=last.name,
        step_key=last.step_key,
        start_time=segments[0].start_time,
        source=segments[0].source,
    )


def layer_values(
    run: MemoryRun, field: str, step: int | None = None
) -> tuple[list[int], list[float]]:
    """Per-layer ``field`` at ``step`` (default: the last step that logged it), layers in order."""
    layers = run.layers(field)
    keys = [layer_key(i, field) for i in layers]
    if step is None:
        logged = [
            i for i in range(len(run.steps)) if any(run.series[k][i] is not None for k in keys)
        ]
        if not logged:
            return [], []
        index = logged[-1]
    elif step in run.steps:
        index = run.steps.index(step)
    else:
        raise ValueError(
            f"{run.label} has no step {step}; it logged {run.steps[0]}..{run.steps[-1]}"
        )
    pairs = [(i, run.series[k][index]) for i, k in zip(layers, keys, strict=True)]
    return [i for i, v in pairs if v is not None], [v for _, v in pairs if v is not None]


def depth_curve(
    run: MemoryRun, step: int | None = None
) -> tuple[list[int], list[float], str | None]:
    """(layers, MiB, field) along depth: allocator figures on CUDA, else cumulative saved bytes.

    ``field`` is None when the run logged no per-layer metrics (per-layer profiling off).
    """
    field = next((f for f in DEPTH_FIELDS if run.layers(f)), None)
    if field is None:
        return [], [], None
    layers, values = layer_values(run, field, step)
    return layers, values, field


def _is_metric(key: str) -> bool:
    return key.startswith("memory/") and key != "memory/step"


def _number(key: str, value: Any) -> float | None:
    """JSON numbers and CSV cells; float() also reads W&B's "NaN"/"Infinity" strings."""
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} = {value!r} is not a number") from None


def _series(
    rows: Iterable[tuple[int, dict[str, Any]]],
) -> tuple[list[int], dict[str, list[float | None]]]:
    """Align rows on their step; rows logged at the same step are merged."""
    merged: dict[int, dict[str, float]] = {}
    for step, row in rows:
        values = {k: _number(k, v) for k, v in row.items() if _is_metric(k)}
        merged.setdefault(step, {}).update({k: v for k, v in values.items() if v is not None})
    steps = sorted(merged)
    keys = sorted({k for values in merged.values() for k in values})
    return steps, {k: [merged[s].get(k) for s in steps] for k in keys}


def _no_memory(source: Path, keys: Iterable[str]) -> ValueError:
    shown = sorted(k for k in set(keys) if not k.startswith("_"))
    listed = ", ".join(shown[:10]) + (f", ... ({len(shown)} keys)" if len(shown) > 10 else "")
    return ValueError(
        f"{source} has no memory metrics (no 'memory/...' keys); it has: {listed or 'none'}. "
        "Was the run trained with the memory profiler on?"
    )


def _load_csv(path: Path) -> MemoryRun:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            columns = reader.fieldnames or []
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path} is not a readable CSV: {e}") from e
    if "step" not in columns:
        raise ValueError(f"{path} has no 'step' column; expected a memory.csv (step, memory/...)")
    ragged = next((i for i, r in enumerate(rows, start=2) if None in r or None in r.values()), None)
    if ragged is not None:  # DictReader files extra cells under None and pads missing ones
        raise ValueError(f"{path}:{ragged}: the row's cells do not match the header's columns")
    try:
        steps, series = _series((int(float(r["step"])), r) for r in rows)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if not rows:  # a run that died before its first step: the header names the keys
        raise ValueError(f"{path} has a header but no rows: the run logged no step")
    if not series:
        raise _no_memory(path, [c for c in columns if c != "step"])
    label = path.resolve().parent.name
    return MemoryRun(label=label, config={}, steps=steps, series=series, source=path)


def _wandb_file(path: Path) -> Path:
    """The run's ``.wandb`` log; a parent ``wandb/`` directory is refused, not guessed from."""
    if path.is_file():
        if path.suffix == ".wandb":
            return path
        raise ValueError(
            f"{path} is not a W&B run: pass a run directory, its .wandb file or a .csv"
        )
    logs = sorted(path.glob("*.wandb"))
    if len(logs) == 1:
        return logs[0]
    if logs:
        raise ValueError(f"{path} holds several .wandb logs; pass one: {', '.join(map(str, logs))}")
    inside = sorted(str(p.parent) for p in path.glob("*/*.wandb") if not p.parent.is_symlink())
    hint = f"; run directories inside it: {', '.join(inside[:5])}" if inside else ""
    raise ValueError(f"{path} is not a W&B run directory (no .wandb file in it){hint}")


def _wandb_cli() -> str:
    """The ``wandb`` next to this interpreter (its venv), else the one on PATH."""
    found = shutil.which("wandb", path=str(Path(sys.executable).parent)) or shutil.which("wandb")
    if found is None:
        raise FileNotFoundError(
            f"reading a W&B run needs the `wandb` command: {missing_extra_line('wandb')}"
        )
    return found


def _leet_records(log: Path) -> list[dict[str, Any]]:
    command = [_wandb_cli(), "leet", "inspect", "--json", str(log)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _load_wandb(log: Path) -> MemoryRun:
    config: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    for record in _leet_records(log):
        kind = record.get("type")
        if kind == "run":
            meta = record["run"]
            config.update(meta.get("config", {}).get("update", {}))
        elif kind == "config":  # run.config.update(...) after init
            config.update(record["config"].get("update", {}))
        elif kind == "history":
            history.append(record["history"]["item"])
    config.pop("_wandb", None)
    rows = [item for item in history if any(_is_metric(k) for k in item)]
    if not rows:
        raise _no_memory(log.parent, (k for item in history for k in item))
    step_key = next(k for k in STEP_KEYS if all(k in item for item in rows))
    steps, series = _series((int(float(item[step_key])), item) for item in rows)
    run_id = meta.get("run_id")
    name = meta.get("display_name") or run_id
    return MemoryRun(
        label=config.get("mlp_impl") or name or log.stem,
        config=config,
        steps=steps,
        series=series,
        run_id=run_id,
        name=name,
        step_key=step_key,
        start_time=meta.get("start_time"),
        source=log,
    )
