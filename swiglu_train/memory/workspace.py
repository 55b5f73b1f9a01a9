"""A W&B workspace of the memory metrics, laid out from the keys the runs actually logged.

Building needs no network; ``Workspace.save()`` does (and a W&B login), so callers save
separately and can report a failed save without losing anything else.
"""

from __future__ import annotations

import re

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from swiglu_train.memory.runs import MAIN_KEYS, MemoryRun, layer_key

_ENTITY_PROJECT = re.compile(r"([\w.-]+)/([\w.-]+)")
_LAYER_FIELDS = ("saved_MiB", "cumulative_saved_MiB", "mlp_saved_MiB", "allocated_MiB")


def parse_entity_project(value: str) -> tuple[str, str]:
    match = _ENTITY_PROJECT.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"expected ENTITY/PROJECT (e.g. my-team/swiglu-train), got {value!r}")
    return match[1], match[2]


def x_axis(runs: list[MemoryRun]) -> str:
    """The step key the W&B runs share; ``memory/step`` for CSVs; W&B's own Step if mixed."""
    logged = {r.step_key for r in runs} & {"memory/step", "trainer/global_step"}
    if len(logged) > 1:
        return "Step"
    return logged.pop() if logged else "memory/step"


def build_workspace(entity_project: str, runs: list[MemoryRun]) -> ws.Workspace:
    """Line plots of the memory keys per step, per impl and per layer; runs grouped by W&B
    group, then by ``mlp_impl`` so two impls sharing a group still draw separate lines."""
    entity, project = parse_entity_project(entity_project)
    if not runs:
        raise ValueError("no runs to build a workspace from")
    x = x_axis(runs)
    logged = {k for r in runs for k in r.series if r.has(k)}

    def plot(title: str, keys: list[str]) -> wr.LinePlot:
        return wr.LinePlot(title=title, x=x, y=keys, title_y="MiB")

    per_step = [plot(k.removeprefix("memory/"), [k]) for k in MAIN_KEYS if k in logged]
    impl_keys = sorted(k for k in logged if k.startswith("memory/impl/"))
    layers = sorted({i for r in runs for field in _LAYER_FIELDS for i in r.layers(field)})
    per_layer = [
        plot(f"layer {i}", [k for f in _LAYER_FIELDS if (k := layer_key(i, f)) in logged])
        for i in layers
    ]
    sections = [
        ws.Section(name="Memory per step", panels=per_step, is_open=True),
        ws.Section(name="Memory per MLP impl", panels=[plot("saved per impl", impl_keys)]),
        ws.Section(name="Memory per layer", panels=per_layer, is_open=True),
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name="swiglu-train memory: " + " vs ".join(r.label for r in runs),
        sections=[s for s in sections if s.panels and all(p.y for p in s.panels)],
        settings=ws.WorkspaceSettings(x_axis=x),
        runset_settings=ws.RunsetSettings(
            groupby=[ws.Metric("Group"), ws.Config("mlp_impl")],
            pinned_runs=[r.run_id for r in runs if r.run_id],
        ),
    )
