"""docs/configuration.md is what the config's dataclasses say, every key described."""

from __future__ import annotations

import dataclasses

from spotline.launch.config_reference import OUTPUT, field_comments, render, undocumented


def test_every_key_has_a_description() -> None:
    assert undocumented() == []


def test_the_committed_reference_is_what_the_dataclasses_write() -> None:
    assert OUTPUT.read_text() == render(), "run python -m spotline.launch.config_reference"


@dataclasses.dataclass(frozen=True)
class _Sample:
    # Two lines above
    # the field.
    above: int = 1
    inline: str = "x"  # at its line's end
    bare: bool = False


def test_a_fields_description_is_the_comment_beside_it() -> None:
    # What the reference reads, on a class of its own: a field without a comment has none
    # (undocumented() then names its key unless a flag describes it).
    assert field_comments(_Sample) == {
        "above": "Two lines above the field.",
        "inline": "at its line's end",
    }
