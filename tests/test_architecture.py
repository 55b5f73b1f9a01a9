"""The package's layering, read from its source (CPU, no imports run): no import circle among
its modules, and no import that runs up the house (docs/architecture.md draws it).

Every import counts, those inside functions too: a lazy import hides a circle from Python's
import machinery, not from the reader who has to hold both files in mind.

``python tests/test_architecture.py`` rewrites the drawing in docs/architecture.md.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "swiglu_train"
DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- drawing: begin -->", "<!-- drawing: end -->"

# The floors of the house, bottom (0) to top. A module imports only from its own floor or
# below. The helpers are leaves (they import nothing of ours), so every floor may use them;
# gc_pauses and compile_workers time and tidy training runs, which only the integrations do.
RANKS: dict[str, int] = {
    "files": 0,
    "extras": 0,
    "tables": 0,
    "kernels": 1,
    "ops": 2,
    "layers": 3,
    "packing": 4,
    "memory": 4,
    "gc_pauses": 5,
    "compile_workers": 5,
    "integrations": 5,
    "bench": 6,
    "cli": 6,
    "__init__": 7,  # the package's face: re-exports ParMLP and patch
    "__main__": 7,
}
FLOORS = ("helpers", "kernels", "ops", "layers", "packing, memory", "integrations",
          "bench, cli", "the package's face")  # fmt: skip


@functools.cache
def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``'s)."""
    files = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    """The dotted names an import statement names, relative ones made absolute."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + is_package]
            base = ".".join([*anchor, base] if base else anchor)
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its body. ``from a import b``
    points at ``a.b`` where that is a module, else at ``a``."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = list(_imported(node, module, is_package))
            if isinstance(node, ast.ImportFrom):
                base, members = names[0], [n for n in names[1:] if n in files]
                names = members or [base]
            targets.update(owner for name in names if (owner := _owner(name, files)))
        graph[module] = targets - {module}
    return graph


def _owner(name: str, files: dict[str, Path]) -> str | None:
    """The package's module that ``name`` is or lies in (``a.b.func`` -> ``a.b``), or None."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def rank(module: str) -> int:
    parts = module.split(".")
    return RANKS[parts[1] if len(parts) > 1 else "__init__"]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules around it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} (floor {rank(module)}) imports {target} (floor {rank(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if rank(target) > rank(module)
    ]


def room(module: str) -> str:
    """Where a module lives: its sub-package (``bench.grid``), or its own name at the top."""
    path = module_files()[module].relative_to(ROOT / PACKAGE)
    if len(path.parts) == 1:
        return PACKAGE if path.stem == "__init__" else path.stem
    return ".".join(path.parent.parts)


def room_graph() -> dict[str, set[str]]:
    """room -> the other rooms its modules import."""
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in import_graph().items():
        here = room(module)
        rooms[here].update(room(t) for t in targets if room(t) != here)
    return dict(rooms)


def drawing(width: int = 96) -> str:
    """The rooms floor by floor, top down, with an arrow down between floors: the only way an
    import may run. It names rooms, not their imports, so it changes when a room does."""
    floor = {room(module): rank(module) for module in module_files()}
    blocks = []
    for level in range(len(FLOORS) - 1, -1, -1):
        rooms = sorted(r for r, f in floor.items() if f == level)
        if not rooms:
            continue
        label, lines = f"{level} {FLOORS[level]}", [""]
        for r in rooms:
            if lines[-1] and len(f"{label:<22}{lines[-1]}  {r}") > width:
                lines.append("")
            lines[-1] = f"{lines[-1]}  {r}" if lines[-1] else r
        blocks.append(
            "\n".join(f"{label if i == 0 else '':<22}{line}" for i, line in enumerate(lines))
        )
    return "\n      |\n      v\n".join(blocks)


def documented_drawing() -> str:
    text = DOC.read_text()
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    return block.removeprefix("```text").removesuffix("```").strip()


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_circle_between_rooms():
    """Sub-packages too: a room that imports another which imports it back is one room."""
    cycle = find_cycle(room_graph())
    assert cycle is None, "circle between sub-packages: " + " -> ".join(cycle or [])


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_every_top_level_name_has_a_floor():
    tops = {m.split(".")[1] for m in module_files() if "." in m}
    assert tops <= set(RANKS), f"give {sorted(tops - set(RANKS))} a floor in RANKS"


def test_each_bench_room_says_what_it_serves():
    """bench/ is split by what a user runs: each sub-package names its command on its face."""
    rooms = [p for p in (ROOT / PACKAGE / "bench").iterdir() if p.is_dir() and p.name[0] != "_"]
    for path in rooms:
        init = path / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        assert doc and doc.startswith(("``swiglu-train ", "``benchmarks/")), init


def test_the_drawing_in_the_docs_is_the_code_s():
    assert documented_drawing() == drawing(), "run: python tests/test_architecture.py"


def test_the_graph_sees_lazy_and_relative_imports():
    """The reader itself: an import inside a function counts, and so does a relative one."""
    tree = ast.parse("def f():\n    from .b import c\n    import swiglu_train.ops\n")
    names = [n for node in ast.walk(tree) for n in _imported(node, "swiglu_train.x.a", False)]
    assert names == ["swiglu_train.x.b", "swiglu_train.x.b.c", "swiglu_train.ops"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


if __name__ == "__main__":
    text = DOC.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(f"{text[:start]}\n```text\n{drawing()}\n```\n{text[stop:]}")
