"""The install: extras that leave the user's torch alone, CI's own pins, and a test extra that
brings every package the suite imports (a fresh clone's CI has nothing else)."""

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from swiglu_train.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CI = (ROOT / ".ci" / "run").read_text()
# Imported by GPU-only tests, and installable only on the GPU box (DESIGN.md).
GPU_ONLY = {"quack", "transformer_engine", "cutlass"}
TORCH_STACK = {"torch", "triton", "numpy"}


def requirements(extra: str | None = None) -> list[Requirement]:
    group = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(r) for r in group]


def closure(roots: list[Requirement]) -> set[str]:
    """Every distribution these requirements bring: ours through pyproject, others through the
    metadata of what is installed (the environment CI builds from the same requirements)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if name == "swiglu-train":
            todo += requirements() + [r for e in req.extras for r in requirements(e)]
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            deps = [Requirement(r) for r in requires(name) or []]
        except PackageNotFoundError:
            continue
        for dep in deps:
            wanted = dep.marker is None or any(
                dep.marker.evaluate({"extra": e}) for e in ("", *req.extras)
            )
            if wanted:
                todo.append(Requirement(str(dep).split(";")[0]))
    return seen


def test_no_extra_pins_the_torch_stack():
    """An exact Triton pin made pip replace the user's torch (and fetch a 555 MB wheel first)."""
    groups = {"dependencies": requirements()} | {
        f"[{e}]": requirements(e) for e in PROJECT["optional-dependencies"]
    }
    for group, reqs in groups.items():
        for req in reqs:
            if canonicalize_name(req.name) in TORCH_STACK:
                upper = [s for s in req.specifier if s.operator in ("==", "===", "~=", "<", "<=")]
                assert not upper, f"{group} caps {req.name}: {req}"


def test_ci_installs_what_the_cpu_interpreter_needs_and_builds_the_docs():
    install = next(line for line in CI.splitlines() if '-e ".[test,docs]"' in line)
    assert '"triton==3.6.0"' in install and '"numpy<2.4"' in install  # one resolve, no downgrade
    assert re.search(r"^(\w+=\S+ )*mkdocs build --strict\b", CI, re.M)
    assert CI.rstrip().splitlines()[-1] == 'python -m pytest -m "not gpu" -n auto'  # the README's


def test_every_ci_command_stops_the_run_when_it_fails():
    """Under ``set -e`` a failure inside an ``&&`` or ``||`` list, or a pipeline's but the
    last without pipefail, does not stop the script: ``ruff check . && ruff format --check .``
    let a lint error through with exit 0. So the gates run one to a line, and lint is one."""
    commands = [line for line in CI.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[0] == "set -euo pipefail"
    for line in commands:
        assert " && " not in line and " || " not in line, line
    assert {"ruff check .", "ruff format --check ."} <= set(commands)


def test_the_test_extra_brings_every_package_the_tests_import():
    local = {p.stem for p in (ROOT / "tests").glob("*.py")}
    imported: dict[str, str] = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "importorskip"
                and isinstance(node.args[0], ast.Constant)
            ):
                names = [node.args[0].value]
            for name in names:
                imported.setdefault(name.partition(".")[0], path.name)
    third_party = {
        m: f
        for m, f in imported.items()
        if m not in sys.stdlib_module_names | local | GPU_ONLY and not m.startswith("swiglu_train")
    }
    brought = closure(requirements("test"))
    owners = packages_distributions()
    missing = {
        m: f
        for m, f in third_party.items()
        if not {canonicalize_name(d) for d in owners.get(m, [])} & brought
    }
    assert not missing, f"imported by tests, not brought by the test extra: {missing}"


def test_each_extra_named_in_messages_brings_its_package():
    """The one-line hint for a missing module names an extra that really installs it."""
    for module, (package, extra) in EXTRAS.items():
        assert canonicalize_name(package) in closure(requirements(extra)), (module, extra)


def test_the_installed_distributions_satisfy_each_other():
    """`pip check`. CI installs the hf extra alone, then the test extra over it, as a user adds
    extras: newer transformers brought kernels 0.19, which needs a huggingface-hub that the test
    extra's pins refuse, and the suite ran on an environment pip called broken."""
    assert re.search(r'pip install .*-e "\.\[hf\]".*\n(.*\n)*.*-e "\.\[test,docs\]"', CI)
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


DOCS_BUILD = re.search(r"^(\w+=\S+ )*mkdocs build\b.*$", CI, re.M)[0]
# Each: the file broken, the text replaced (None: appended to), its replacement, what the
# build's error names.
BREAKS = {
    "nothing": None,  # the control: the copy as it is builds
    "a link to no page": ("docs/install.md", None, "[x](no_such_page.md)", "no_such_page.md"),
    "a link to no anchor": ("docs/install.md", None, "[x](impls.md#no-such-part)", "no-such-part"),
    "an image that does not exist": ("docs/install.md", None, "![x](images/no.png)", "no.png"),
    "a nav entry naming no file": ("mkdocs.yml", "install.md\n", "no_such.md\n", "no_such.md"),
    "a page left out of the nav": ("mkdocs.yml", "      - Checkpoints: checkpoints.md\n", "",
                                   "checkpoints.md"),
}  # fmt: skip


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="the docs extra builds the site")
@pytest.mark.parametrize("broken", BREAKS)
def test_ci_s_docs_build_fails_on_a_broken_link(tmp_path, broken):
    """CI built the site with --quiet, which drops the warnings that --strict counts: a link to
    a page that does not exist passed. Its command, on a copy of the site broken in one place
    (docs/install.md says why the site is not on Zensical, which passes the last three)."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")  # symlinked figures copied as files
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    if BREAKS[broken] is not None:
        path, old, new, _ = BREAKS[broken]
        text = (tmp_path / path).read_text()
        assert old is None or text.count(old) == 1, old
        (tmp_path / path).write_text(f"{text}\n{new}\n" if old is None else text.replace(old, new))
    done = subprocess.run(DOCS_BUILD, shell=True, cwd=tmp_path, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if BREAKS[broken] is None:
        assert done.returncode == 0, output[-3000:]
    else:
        assert done.returncode != 0 and BREAKS[broken][3] in output, output[-3000:]
