"""Optional dependencies: which pip extra brings each, and the one line that says so.

A leaf module (no swiglu_train imports), so every layer can name an extra the same way.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# The top-level module a command imports -> (the package pip installs, the extra that brings it).
# tests/test_extras.py checks each pair against pyproject.toml.
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("matplotlib", "plot"),
    "wandb": ("wandb", "wandb"),
    "wandb_workspaces": ("wandb-workspaces", "wandb"),
    "lightning": ("lightning", "lightning"),
    "yaml": ("PyYAML", "lightning"),  # configs are YAML; lightning brings PyYAML
    "megatron": ("megatron-core", "megatron"),
    "psutil": ("psutil", "megatron"),
    "quack": ("quack-kernels", "quack"),
    "nbformat": ("nbformat", "notebook"),
    "nbclient": ("nbclient", "notebook"),
    "transformers": ("transformers", "hf"),
    "safetensors": ("safetensors", "hf"),
    "litgpt": ("litgpt", "litgpt"),
    "torchao": ("torchao", "fp8"),
}


def install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this install: run from a clone (the README's
    ``pip install -e .``), the clone by its path, as ``swiglu-train[plot]`` would fetch a copy."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return f"pip install -e '{root}[{extra}]'"
    return f"pip install 'swiglu-train[{extra}]'"


class MissingExtra(ImportError):
    """An optional dependency missing, in one line that names the extra and the pip command
    that bring it; the CLI prints it as it is."""

    def __init__(self, what: str, extra: str) -> None:
        super().__init__(f"{what}; the [{extra}] extra brings it: {install_command(extra)}")


def missing_extra_line(module: str) -> str | None:
    """One line naming the extra that brings ``module`` (a dotted name is read by its top
    level); None for a module that no extra brings."""
    found = EXTRAS.get(module.partition(".")[0])
    if found is None:
        return None
    package, extra = found
    return f"{package} is not installed; the [{extra}] extra brings it: {install_command(extra)}"


def explain(e: ImportError) -> str | None:
    """What to install, in one line, for an ImportError a command raised; None where no extra
    would help (a bug, or a broken install), so that its traceback is kept."""
    if isinstance(e, MissingExtra):
        return str(e)
    if e.name and (line := missing_extra_line(e.name)):
        return line
    return None


def require(*modules: str) -> None:
    """Import optional modules now, so a missing one is reported before a command's work
    (a run that would fail on its plot after minutes) rather than after it."""
    for module in modules:
        importlib.import_module(module)
