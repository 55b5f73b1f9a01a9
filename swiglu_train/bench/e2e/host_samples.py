"""Where a run's host time goes, sampled by py-spy: which Python frames were on the stack while
the process (and its children) ran. A step whose GPU waits on the host shows up here as the
frames that held it, which a kernel profile cannot show (stock Megatron's slow runs,
docs/planner.md).

``sampled(command, path)`` wraps a command in ``py-spy record`` writing py-spy's raw
("collapsed") stacks; ``top_frames(path)`` reads them back as each frame's inclusive share of
the samples. py-spy is an optional tool: ``pip install py-spy``.
"""

from __future__ import annotations

import collections
import re
import shutil
import sys
from pathlib import Path

RATE_HZ = 100  # samples a second: 1 % of a core, enough to see a 10 ms stall per step
_RECORD = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<name>.+ \([^()]*?)(?::\d+)?\)$")  # "function (file:line)"


def sampled(command: list[str], path: Path, native: bool = False) -> list[str]:
    """``command`` under py-spy, its raw stacks (and its children's) written to ``path``;
    ``native``: C and C++ frames too (``--native``), where a stall below one Python line sits.
    A ValueError before anything runs where py-spy is not installed. It is looked for on PATH,
    then beside this Python: a virtual environment used without activating it (the GPU box's)
    installs it there, off PATH."""
    beside_python = str(Path(sys.executable).parent)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=beside_python)
    if spy is None:
        raise ValueError(
            f"host sampling needs py-spy, on PATH or in {beside_python}: pip install py-spy"
        )
    return [spy, "record", "--rate", str(RATE_HZ), "--subprocesses", "--format", "raw",
            *(["--native"] if native else []), "--output", str(path), "--", *command]  # fmt: skip


def top_frames(path: Path, top: int = 15, within: str | None = None) -> dict:
    """The samples in py-spy's raw file: their count, the ``top`` frames by inclusive share (a
    frame counted once per sample, wherever it sits in the stack), and the ``top`` leaves by
    self share (the innermost frame of each sample: where the time was spent, which names a
    stall below the Python line that waited on it).

    ``within`` (a function's name): only the samples taken inside it, and only it and the
    frames it called, such as a training step's, where a whole run's would be mostly start-up
    and imports. Frames are named by function and file, line numbers dropped, so a loop's lines
    add up; what is not a frame (the process names py-spy puts first on each stack, which a
    command line may break over lines) is left out."""
    per_frame: collections.Counter[str] = collections.Counter()
    per_leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        record = _RECORD.match(line)
        if record is None:  # part of a process name broken over lines
            continue
        named = (_FRAME.match(f) for f in record["stack"].split(";"))
        stack = [m["name"] + ")" for m in named if m is not None]  # outermost first
        if within is not None:  # from the function down: its callers say nothing
            inside = [i for i, f in enumerate(stack) if f.startswith(within + " (")]
            if not inside:
                continue
            stack = stack[inside[0] :]
        frames = dict.fromkeys(stack)  # once per sample; ties rank outermost first
        count = int(record["count"])
        total += count
        for frame in frames:
            per_frame[frame] += count
        if stack:
            per_leaf[stack[-1]] += count
    shares = [{"frame": f, "share": n / total} for f, n in per_frame.most_common(top)]
    leaves = [{"frame": f, "share": n / total} for f, n in per_leaf.most_common(top)]
    return {"samples": total, "frames": shares if total else [], "leaves": leaves}
