"""Every code block in the README runs as written: its Python blocks are executed here (on
CPU, as the README says they run), and each line of its bash blocks is a command this clone
knows, with options and extras that exist."""

import ast
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from swiglu_train.cli import app
from swiglu_train.extras import EXTRAS as EXTRA_OF_MODULE
from swiglu_train.integrations.lightning.config import PretrainConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.M | re.S)
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = set(PROJECT["optional-dependencies"])
CI = (ROOT / ".ci" / "run").read_text()
COMMANDS = typer.main.get_command(app).commands
CPU_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


def blocks(language: str) -> list[str]:
    return [code for lang, code in BLOCKS if lang == language]


def bash_lines() -> list[str]:
    lines = [line.split("  #")[0].strip() for code in blocks("bash") for line in code.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_has_code_blocks_of_known_languages():
    assert blocks("python") and blocks("bash")
    assert {lang for lang, _ in BLOCKS} <= {"python", "bash"}


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[-1][:40])
def test_python_blocks_run_as_written(code):
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("line", bash_lines())
def test_bash_lines_are_commands_this_clone_knows(line):
    words = shlex.split(line)
    if line == CPU_TORCH:
        return
    if words[:2] == ["pip", "install"]:
        [target] = [w for w in words[2:] if w != "-e"]
        found = re.fullmatch(r"\.\[([\w,]+)\]", target)
        assert found and "-e" in words, f"{line}: install this clone with -e and extras"
        assert set(found[1].split(",")) <= EXTRAS, f"{line}: no such extra"
    elif words[:3] == ["python", "-m", "pytest"]:
        assert line == CI.rstrip().splitlines()[-1], "the README's test command is CI's, verbatim"
    elif words[0] == "swiglu-train":
        command = COMMANDS.get(words[1])
        assert command is not None, f"{line}: no command {words[1]!r}"
        known = {opt for param in command.params for opt in param.opts + param.secondary_opts}
        used = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
        assert used <= known, f"{line}: unknown options {sorted(used - known)}"
        result = CliRunner().invoke(app, [words[1], "--help"])
        assert result.exit_code == 0, result.output
    else:
        pytest.fail(f"{line}: not a command this test knows how to check")


def test_relative_links_point_at_files_of_this_clone():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_a_python_block_names_the_extras_of_what_it_imports():
    """The "Your own model" block imported litgpt and transformers without saying which extras
    bring them: its section must say, in a pip line before the block."""
    for block in re.finditer(r"^```python\n(.*?)^```", README, re.M | re.S):
        imported = {
            name.partition(".")[0]
            for node in ast.walk(ast.parse(block[1]))
            for name in (
                [a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
        }  # fmt: skip
        needed = {EXTRA_OF_MODULE[m][1] for m in imported if m in EXTRA_OF_MODULE}
        section = README[README.rfind("\n## ", 0, block.start()) : block.start()]
        named = {e for found in re.findall(r'pip install -e "\.\[([\w,]+)\]"', section)
                 for e in found.split(",")}  # fmt: skip
        assert needed <= named, f"{sorted(needed - named)} not named before {block[1][:60]!r}"


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="reads this clone's .gitignore with git")
def test_what_the_quickstart_writes_is_git_ignored():
    """Its run directory, PNG and HTML showed in the clone's `git status`."""
    written = []
    for words in map(shlex.split, bash_lines()):
        if words[:2] == ["swiglu-train", "pretrain"]:
            out = words[words.index("--output-dir") + 1] if "--output-dir" in words else None
            written.append(f"{out or PretrainConfig().output_dir}/checkpoints/last.ckpt")
        elif words[:2] == ["swiglu-train", "compare-memory"]:
            out = Path(words[words.index("--out") + 1])
            written += [str(out), str(out.with_suffix(".html"))]
    assert written
    done = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert sorted(done.stdout.split()) == sorted(written), done.stderr


QUICKSTART = ROOT / "benchmarks" / "results" / "lightning" / "quickstart_cpu.json"


def test_the_quickstart_s_time_and_losses_are_the_measured_ones():
    """The README said "2-4 minutes" long after the run had become faster: its time and losses
    are those of the measurement it cites, to the figure it rounds to."""
    measured = json.loads(QUICKSTART.read_text())
    quick = README[README.index("## Quickstart") : README.index("## Test")]
    assert f"`{QUICKSTART.name}`" in quick and measured["command"] in quick
    said = re.search(r"(\d+) steps in about (\d+) s on (\w+) CPU cores", quick)
    assert said, "the Quickstart says: N steps in about T s on K CPU cores"
    assert int(said[1]) == measured["steps"] and said[3] == {2: "two"}[measured["cores"]]
    assert int(said[2]) == round(measured["wall_s"] / 5) * 5  # to the nearest 5 s
    losses = f"from {measured['initial_loss']:.1f} to {measured['final_loss']:.2f}"
    assert losses in " ".join(quick.split())
