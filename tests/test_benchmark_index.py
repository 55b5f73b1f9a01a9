"""benchmarks/README.md indexes every committed result, and every result the README and docs/
cite exists: a number in the docs is only as good as the file it points to."""

import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "benchmarks" / "README.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a result named in backticks, by path or by name: grid_h200.md, e2e/e2e_3b_h200.{json,md,png}
# where a command writes (--out, --json, --md, --plot), the file may be one it will make
CITED_PATH = re.compile(
    r"(?<!--out )(?<!--json )(?<!--md )(?<!--plot )benchmarks/results/[\w./{},-]*[\w}]"
)
CITED_NAME = re.compile(r"`([\w/{},-]+_(?:h200|h100|cpu)(?:\.[\w{},]+)+)`")


def expand(pattern: str) -> list[str]:
    """``a_{x,y}.{json,md}`` -> the four names it stands for (groups side by side, not nested)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def committed(under: Path) -> list[Path]:
    """Tracked files under ``under``: a run's scratch output left in the tree is not a result."""
    out = subprocess.run(
        ["git", "ls-files", "-z", str(under.relative_to(ROOT))],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [ROOT / p for p in out.split("\0") if p]


def tracked_names() -> set[str]:
    return {p.name for p in committed(ROOT)}


def index_names() -> set[str]:
    text = INDEX.read_text() if INDEX.exists() else ""
    return {Path(n).name for token in re.findall(r"`([^`\s]+)`", text) for n in expand(token)}


def test_every_committed_result_is_in_the_index():
    names = index_names()
    missing = [str(p.relative_to(RESULTS)) for p in committed(RESULTS) if p.name not in names]
    assert not missing, f"benchmarks/README.md does not name {len(missing)} results: {missing}"


def test_result_names_are_unique_so_the_index_can_name_them_alone():
    names = [p.name for p in committed(RESULTS)]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_result_a_doc_cites_exists(doc):
    text = doc.read_text()
    tracked = tracked_names()
    dangling = []
    for cited in CITED_PATH.findall(text):
        dangling += [p for p in expand(cited.rstrip(".,")) if not (ROOT / p).exists()]
    for cited in CITED_NAME.findall(text):
        dangling += [name for name in expand(cited) if Path(name).name not in tracked]
    assert not dangling, f"{doc.name} cites results that do not exist: {dangling}"


def test_the_index_cites_only_results_that_exist():
    test_every_result_a_doc_cites_exists(INDEX)


def test_links_into_the_results_resolve():
    """docs/images links some plots to their result files: a move must carry the link along."""
    out = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True)
    links = [line.split("\t")[1] for line in out.stdout.splitlines() if line.startswith("120000")]
    assert [p for p in links if not (ROOT / p).resolve().is_file()] == []
