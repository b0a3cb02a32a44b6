"""The configuration reference (docs/configuration.md), written from the config's dataclasses.

Every key of a config file's ``spotline`` section is a field of one of
``spotline.config``'s section dataclasses; what a key means is written once, beside the
field: the comment above it (or at the end of its line), else the help of the flag that sets
it (``spotline.launch.flags.FLAGS``). This module turns those into one table a section,
with each key's type, default and flag, so the reference cannot drift from the code:
``tests/test_config_reference.py`` fails when the committed file is not what this writes,
or when a key has no description at all.

    python -m spotline.launch.config_reference          # rewrite docs/configuration.md
    python -m spotline.launch.config_reference --check  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from spotline.config import DEFAULT_DEEPSPEED, SpotlineConfig
from spotline.config_reader import type_name
from spotline.launch.flags import FLAGS

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "docs" / "configuration.md"

_PREAMBLE = """\
# Configuration reference

A config file is DeepSpeed's JSON with a `spotline` section. Written by
`python -m spotline.launch.config_reference` from the dataclasses in
`integration/config.py` (a test fails when this file is stale or a key has no description):
edit the comment beside a field there, not this file.

Precedence: a command's flags over `--config`'s file over the defaults below. A key that is
not listed here, a value of the wrong type or out of range, is one line naming the key and
exit 2 (`spotline.config.parse_config`).

## DeepSpeed's keys

Spotline reads DeepSpeed's own keys for what they mean to DeepSpeed:
`train_micro_batch_size_per_gpu` (the micro-batch), `gradient_accumulation_steps`
(micro-batches per logical worker and step), `optimizer` (`Adam` or `AdamW`), `scheduler`
(DeepSpeed's five, the rate of step k a function of k), `gradient_clipping` (by the global
norm over every stage), `bf16`, `fp16` (with DeepSpeed's loss-scaler keys) or
`torch_autocast` (fp32 master weights either way), `zero_optimization.stage` 0 only, and
`pipeline.activation_checkpoint_interval`. The defaults, where the file sets none:

```json
{defaults}
```
"""


def field_comments(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` with the comment above it, or at the end of its line,
    as one sentence block (its ``#`` marks and line breaks removed)."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    out: dict[str, str] = {}
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above: list[str] = []
        row = stmt.lineno - 2  # 0-based index of the line above
        while row >= 0 and lines[row].strip().startswith("#"):
            above.insert(0, lines[row].strip().removeprefix("#").strip())
            row -= 1
        own_line = lines[stmt.lineno - 1]
        if not above and "  # " in own_line:
            above = [own_line.split("  # ", 1)[1].strip()]
        if above:
            out[stmt.target.id] = " ".join(above)
    return out


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return json.dumps(f.default)
    assert f.default_factory is not dataclasses.MISSING, f.name
    return json.dumps(f.default_factory())


def _first_paragraph(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(f"{cls.__name__}("):  # the generated signature: no docstring
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def sections() -> list[tuple[str, type]]:
    """The ``spotline`` section's parts: each name and its dataclass."""
    out: list[tuple[str, type]] = []
    for section in dataclasses.fields(SpotlineConfig):
        cls = section.default_factory
        assert isinstance(cls, type) and dataclasses.is_dataclass(cls), section.name
        out.append((section.name, cls))
    return out


def undocumented() -> list[str]:
    """Keys with neither a comment beside their field nor a flag's help."""
    flags = {f.key for f in FLAGS}
    return [
        f"spotline.{name}.{f.name}"
        for name, cls in sections()
        for f in dataclasses.fields(cls)
        if f.name not in field_comments(cls) and f"spotline.{name}.{f.name}" not in flags
    ]


def render() -> str:
    """docs/configuration.md."""
    flags = {f.key: f for f in FLAGS}
    defaults = json.dumps(DEFAULT_DEEPSPEED, indent=2)
    parts = [_PREAMBLE.format(defaults=defaults)]
    for name, cls in sections():
        hints = typing.get_type_hints(cls)
        comments = field_comments(cls)
        parts.append(f"\n## spotline.{name}\n")
        intro = _first_paragraph(cls)
        if intro:
            parts.append(f"\n{intro}\n")
        parts.append("\n| key | type | default | flag | meaning |\n|---|---|---|---|---|\n")
        for f in dataclasses.fields(cls):
            key = f"spotline.{name}.{f.name}"
            flag = flags.get(key)
            meaning = comments.get(f.name) or (flag.help if flag is not None else "")
            cells = [
                f"`{f.name}`",
                type_name(hints[f.name]),
                f"`{_default_text(f)}`",
                f"`{flag.name}`" if flag is not None else "",
                meaning.replace("|", "\\|"),
            ]
            parts.append("| " + " | ".join(cells) + " |\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotline.launch.config_reference")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python -m spotline.launch.config_reference")
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
