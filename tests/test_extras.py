"""A missing optional dependency is one line naming the extra that brings it.

Modules are made missing the way Python itself reports one: ``sys.modules[name] = None`` makes
``import name`` raise a real ModuleNotFoundError. Package modules that import it at their top
are dropped from the cache for the test, so their import runs again.
"""

import ast
import sys
from pathlib import Path

import pytest

from swiglu_train.cli import app
from swiglu_train.extras import EXTRAS, install_command, missing_extra_line

ROOT = Path(__file__).resolve().parents[1]


def hide(monkeypatch, module: str, importers: tuple[str, ...] = ()) -> None:
    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in importers:
        monkeypatch.delitem(sys.modules, name, raising=False)


@pytest.fixture
def entry(monkeypatch, capsys):
    """``swiglu-train ARGS`` through the console-script entry point: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Typer installs its own
    monkeypatch.delenv("SWIGLU_TRAIN_DEBUG", raising=False)

    def run(*args: object) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as exit_:
            app(args=[str(a) for a in args], prog_name="swiglu-train")
        out = capsys.readouterr()
        return exit_.value.code, out.out, out.err

    return run


PLOTS = ("swiglu_train.memory.plots", "swiglu_train.bench.inference.plot")
CASES = {
    "compare-memory": (("compare-memory", "run.csv", "--out", "{tmp}/m.png"), "matplotlib", PLOTS),
    "bench-memory --json": (
        ("bench-memory", "--device", "cpu", "--layers", "1", "--json", "{tmp}/s.json"),
        "matplotlib",
        (),
    ),
    "bench-inference --plot": (
        ("bench-inference", "--merge", "{tmp}/r.json", "--plot", "{tmp}/p.png"),
        "matplotlib",
        PLOTS,
    ),
    "pretrain without lightning": (("pretrain", "--output-dir", "{tmp}/run"), "lightning", ()),
    "pretrain without wandb": (("pretrain", "--output-dir", "{tmp}/run"), "wandb", ()),
    "pretrain --model litgpt": (
        ("pretrain", "--model", "litgpt:pythia-14m", "--output-dir", "{tmp}/run"),
        "litgpt",
        (),
    ),
    "export-hf": (("export-hf", "{tmp}/run.ckpt", "{tmp}/hf"), "transformers", ()),
    "import-hf": (("import-hf", "{tmp}/hf", "{tmp}/run.ckpt"), "transformers", ()),
    "bench-grid --plot": (
        ("bench-grid", "--merge", "{tmp}/r.json", "--plot", "{tmp}/p.png"),
        "matplotlib",
        (),
    ),
    "compare-memory --wandb-workspace": (
        ("compare-memory", "run.csv", "--out", "{tmp}/m.png", "--wandb-workspace", "e/p"),
        "wandb_workspaces",
        ("swiglu_train.memory.workspace",),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_missing_extra_is_one_line_naming_it(entry, monkeypatch, tmp_path, case):
    args, module, importers = CASES[case]
    hide(monkeypatch, module, importers)
    code, out, err = entry(*(a.format(tmp=tmp_path) for a in args))
    package, extra = EXTRAS[module]
    assert code == 1 and out == ""
    assert err == f"error: {package} is not installed; the [{extra}] extra brings it: " + (
        f"{install_command(extra)}\n"
    )
    assert list(tmp_path.iterdir()) == []  # refused before any work


def test_reading_a_wandb_run_without_the_wandb_command_names_the_extra(
    entry, monkeypatch, tmp_path
):
    """compare-memory reads .wandb logs through `wandb leet`: a PATH without it, and no wandb
    beside the interpreter, is what an install without the wandb extra looks like."""
    run = tmp_path / "offline-run-1"
    run.mkdir()
    (run / "run-1.wandb").write_bytes(b"")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    code, _, err = entry("compare-memory", run, "--out", tmp_path / "m.png")
    assert code == 2 and err.count("\n") == 1
    assert f"the [wandb] extra brings it: {install_command('wandb')}" in err


def test_the_install_command_names_this_clone():
    """Installed with -e from this clone (the README's way), the hint installs the clone again
    with the extra, not a copy from the registry."""
    assert install_command("plot") == f"pip install -e '{ROOT}[plot]'"


def test_a_module_no_extra_brings_keeps_its_traceback(entry, monkeypatch):
    """A bug (an import of a module that does not exist) is not taken for a missing extra."""
    import swiglu_train.integrations.lightning.config as config

    def broken(name):
        import swiglu_train_no_such_module  # noqa: F401

    monkeypatch.setattr(config, "load_config", broken)
    with pytest.raises(ModuleNotFoundError, match="swiglu_train_no_such_module"):
        app(args=["pretrain"], prog_name="swiglu-train")
    assert missing_extra_line("swiglu_train_no_such_module") is None


def test_no_message_names_an_extra_without_the_pip_command_for_this_install():
    """Messages that said "install swiglu-train[hf]" left a user of a clone (the README's
    ``pip install -e .``) to work out the command; install_command writes it for either."""
    found = []
    for path in sorted((ROOT / "swiglu_train").rglob("*.py")):
        if path.name == "extras.py":  # install_command: the one place that spells it
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        found += [
            f"{path.relative_to(ROOT)}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "swiglu-train[" in node.value
            and id(node) not in docstrings
        ]
    assert not found, found
