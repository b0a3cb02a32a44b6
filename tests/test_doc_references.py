"""What the docs point at exists: every source path and every ``spotline.*`` name in the
docs names a file, a module, a module's top-level name, or a config key.

A doc that points at a module that moved, or at a class that was renamed, sends a reader
to nothing (docs/architecture.md once pointed at ``_Arch`` in a module that did not hold
it). Names are checked against the source (top-level ``def``/``class``/assignments), without
importing the package's heavy modules.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest

from spotline.config import SpotlineConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "launch/README.md",
    "patches/README.md",
    "BENCHMARKS.md",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")),
)
# A placeholder a command template names (``traces/TRACE-trace.csv``): not a path to check.
PLACEHOLDER = re.compile(r"[A-Z]{3,}")
# A source path as docs write it: integration/..., launch/..., tests/..., patches/... .py
PATH = re.compile(r"(?<![\w/.-])((?:integration|launch|tests|patches|configs)/[\w/.-]*\w)")
DOTTED = re.compile(r"(?<![\w.])(spotline(?:\.\w+)+)")
ROOTS = {"spotline": REPO / "integration", "spotline.launch": REPO / "launch"}
ROOTS["spotline.patches"] = REPO / "patches"


def module_file(name: str) -> Path | None:
    """The file of module or package ``name``, or None."""
    for prefix in sorted(ROOTS, key=len, reverse=True):  # spotline.launch before spotline
        if name == prefix:
            return ROOTS[prefix] / "__init__.py"
        if name.startswith(prefix + "."):
            base = ROOTS[prefix].joinpath(*name[len(prefix) + 1 :].split("."))
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


@cache
def top_level_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            # Only explicit re-exports (``import x as x``) are a module's own names.
            names.update(a.asname for a in node.names if a.asname and a.asname == a.name)
    return frozenset(names)


@cache
def class_members(path: Path, cls: str) -> frozenset[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            found = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            found |= {
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            return frozenset(found)
    return frozenset()


def config_keys() -> set[str]:
    """Every ``spotline.<section>[.<key>]`` of the config JSON."""
    keys = {"spotline"}
    for section in dataclasses.fields(SpotlineConfig):
        keys.add(f"spotline.{section.name}")
        section_type = section.default_factory()  # type: ignore[misc]
        keys.update(f"spotline.{section.name}.{f.name}" for f in dataclasses.fields(section_type))
    return keys


def resolves(dotted: str, keys: set[str]) -> bool:
    """A module, a module's top-level name, a class's member, or a config key."""
    if dotted in keys:
        return True
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if rest[0] not in top_level_names(path):
            return False
        return len(rest) == 1 or (len(rest) == 2 and rest[1] in class_members(path, rest[0]))
    return False


def references(doc: str) -> tuple[list[str], list[str]]:
    text = (REPO / doc).read_text()
    paths = [m.rstrip(".") for m in PATH.findall(text) if not PLACEHOLDER.search(m)]
    return paths, DOTTED.findall(text)


def test_the_reader_sees_what_it_checks() -> None:
    keys = config_keys()
    assert resolves("spotline.redundancy.mode", keys)  # a config key, not a module
    assert resolves("spotline.worker.holdings.roll_forward", keys)
    assert resolves("spotline.plan.grid.Layout.members", keys)
    assert not resolves("spotline.worker.elastic.roll_forward", keys)  # moved out
    assert not resolves("spotline.models.layers._Nothing", keys)
    assert not resolves("spotline.nowhere", keys)
    paths, dotted = references("docs/architecture.md")
    assert "integration/plan/placement.py" in paths and dotted


@pytest.mark.parametrize("doc", DOCS)
def test_every_source_path_and_name_in_the_docs_exists(doc: str) -> None:
    keys = config_keys()
    paths, dotted = references(doc)
    missing_paths = sorted({p for p in paths if not (REPO / p).exists()})
    unknown = sorted({d for d in dotted if not resolves(d, keys)})
    assert missing_paths == [], f"{doc} names paths that do not exist"
    assert unknown == [], f"{doc} names modules or names that do not exist"


# "`Name` in `integration/x.py`", "`Name` entry in `launch/y.py`": a name placed in a file.
PLACED = re.compile(
    r"`(\w+)`(?:\s+(?:entry|class|function|subclass))?\s+in\s+`((?:integration|launch)/[\w/]+\.py)`"
)


@pytest.mark.parametrize("doc", DOCS)
def test_a_name_the_docs_place_in_a_file_is_there(doc: str) -> None:
    placed = PLACED.findall((REPO / doc).read_text())
    wrong = sorted(
        f"{name} in {path}"
        for name, path in placed
        if not (REPO / path).is_file() or name not in top_level_names(REPO / path)
    )
    assert wrong == [], f"{doc} places names in files that do not hold them"


def _shell_commands(text: str, program: str) -> list[list[str]]:
    """Each ``program ...`` command of ``text``'s bash blocks, continuation lines joined."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  # ", 1)[0].strip()
            if line.startswith(program + " "):
                commands.append(shlex.split(line)[1:])
    return commands


@pytest.mark.parametrize("doc", DOCS)
def test_every_train_and_coordinator_command_in_the_docs_parses(doc: str) -> None:
    """A command a reader pastes has flags that exist and values of the right type
    (running it is the tests' and the user's; a typo in a doc is caught here)."""
    import argparse

    from spotline.launch.train_command import build_train_parser

    parsed = 0
    for argv in _shell_commands((REPO / doc).read_text(), "spotline"):
        command, rest = argv[0], argv[1:]
        if command not in ("train", "coordinator") or "..." in " ".join(rest):
            continue
        parsed += 1
        parser = argparse.ArgumentParser(prog=f"spotline {command}", exit_on_error=False)
        build_train_parser(parser)
        if command == "coordinator":
            parser.add_argument("--listen", required=True)
            parser.add_argument("--token-file")
        try:
            _, unknown = parser.parse_known_args(rest)
        except (argparse.ArgumentError, SystemExit) as exc:
            raise AssertionError(f"{doc}: spotline {' '.join(argv)}: {exc}") from None
        assert not unknown, f"{doc}: spotline {' '.join(argv)}: no such flags {unknown}"
    if doc in ("README.md", "docs/training.md"):
        assert parsed >= 5, parsed  # the tour's and the guide's commands were found


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = [
        f"{doc}: {target}"
        for doc in DOCS
        for target in re.findall(r"\]\(([^)#\s]+)\)", (REPO / doc).read_text())
        if not target.startswith(("http://", "https://"))
        and not (REPO / doc).parent.joinpath(target).exists()
    ]
    assert broken == []
