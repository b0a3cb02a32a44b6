"""The package's shape: folders by concern in floors, no import circle, no file too long to
read, one meaning per file and class name.

The import graph is read from the source (every ``import``/``from ... import`` anywhere in a
module, function-local ones included: a local import hides an arrow, it does not remove
it), so the checks run without importing the package.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The package's folders under their import names (pyproject.toml's package-dir).
ROOTS = {"spotline": REPO / "integration", "spotline.launch": REPO / "launch"}
ROOTS["spotline.patches"] = REPO / "patches"
MAX_LINES = 700

# Low to high. A module may import from its own floor and the floors below it, never from
# a floor above. A unit is a folder of spotline (``plan``), a top-level module (``config``),
# or a folder of spotline.launch (``launch.bench``; ``launch`` is its top-level modules).
FLOORS: tuple[tuple[str, ...], ...] = (
    # Nothing of Spotline below them.
    ("spotline", "errors", "run_dir", "atomic_files", "runtime", "patches"),
    # Pure planning (no torch), and the model configs and layers.
    ("plan", "models"),
    # The settings, the simulator, and what crosses the wire.
    ("config", "config_precision", "config_reader", "config_resume", "sim", "wire"),
    # What a run reads and writes.
    ("data", "reports", "checkpointing"),
    # EasyScale's exact reduction, then Bamboo's pipeline engine built on it.
    ("exact",),
    ("pipeline",),
    # The worker processes.
    ("worker",),
    # What a user's script meets, and the single-process oracle.
    ("reference", "hf_script", "hf_arguments", "hf"),
    # The control plane and the entry points.
    ("launch.dev", "launch.control"),
    ("launch.bench", "launch"),
)


def modules() -> dict[str, Path]:
    """Every module of the package by import name."""
    found: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if prefix == "spotline" and parts[0] in ("launch", "patches"):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, wherever in the file the import stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                targets.add(sub if sub in known else module)
    return {t for t in targets if t in known and t != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit_of(name: str) -> str:
    parts = name.split(".")
    if parts[:2] == ["spotline", "launch"]:
        if len(parts) > 3 or (len(parts) == 3 and parts[2] in ("bench", "control", "dev")):
            return f"launch.{parts[2]}" if parts[2] in ("bench", "control", "dev") else "launch"
        return "launch"
    return parts[1] if len(parts) > 1 else "spotline"


def floor_of(unit: str) -> int:
    for number, floor in enumerate(FLOORS):
        if unit in floor:
            return number
    raise AssertionError(f"{unit} is on no floor: add it to FLOORS")


def test_the_checker_sees_local_imports_and_cycles(tmp_path: Path) -> None:
    """The checks below mean something only if the reader sees what they look for."""
    (tmp_path / "a.py").write_text("def f():\n    from spotline.b import x\n")
    (tmp_path / "b.py").write_text("import spotline.a\n")
    known = {"spotline.a", "spotline.b"}
    graph = {
        "spotline.a": imports_of("spotline.a", tmp_path / "a.py", known),
        "spotline.b": imports_of("spotline.b", tmp_path / "b.py", known),
    }
    assert graph == {"spotline.a": {"spotline.b"}, "spotline.b": {"spotline.a"}}
    assert cycles(graph) == [["spotline.a", "spotline.b"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
    assert unit_of("spotline.launch.bench.jobs") == "launch.bench"
    assert unit_of("spotline.launch.cli") == "launch"
    assert unit_of("spotline.plan.layout") == "plan"


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph()
    assert "spotline.errors" in graph["spotline.config"]  # the graph is read, not empty
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_coordinator_s_arrow_to_the_worker_is_an_import_the_tools_see() -> None:
    """The control plane starts the worker by module name; the coordinator also imports
    that module for readers and tools (only while type checking: it loads torch)."""
    graph = import_graph()
    assert "spotline.launch.elastic_worker" in graph["spotline.launch.coordinator"]
    assert "spotline.launch.agent" in graph["spotline.launch.coordinator"]


def test_no_arrow_from_a_lower_floor_to_a_higher_one() -> None:
    graph = import_graph()
    units = {unit_of(name) for name in graph}
    assert units == {u for floor in FLOORS for u in floor}, "FLOORS lists the package's units"
    upward = sorted(
        f"{name} (floor {floor_of(unit_of(name))}) -> {target} (floor {floor_of(unit_of(target))})"
        for name, targets in graph.items()
        for target in targets
        if floor_of(unit_of(target)) > floor_of(unit_of(name))
    )
    assert not upward, "imports up the floors:\n" + "\n".join(upward)


def test_no_source_file_over_700_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"


def test_file_and_class_names_are_unique_in_the_package() -> None:
    """One name, one meaning: two files or two classes named alike hold different things."""
    paths = [p for p in modules().values() if p.name != "__init__.py"]
    files = Counter(p.name for p in paths)
    classes: Counter[str] = Counter()
    for path in paths:
        tree = ast.parse(path.read_text())
        classes.update(node.name for node in tree.body if isinstance(node, ast.ClassDef))
    assert [n for n, c in files.items() if c > 1] == [], "file names used twice"
    assert [n for n, c in classes.items() if c > 1] == [], "class names used twice"
