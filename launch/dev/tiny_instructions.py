"""Write ``integration/assets/instructions/tiny.jsonl``: small instruction records, made here.

    python -m spotline.launch.dev.tiny_instructions [OUT]

Deterministic (a fixed seed, no clock, no network): running it again writes the same bytes,
which ``tests/test_instructions.py`` checks against the shipped file. Six small tasks a tiny
model starts to learn within a few dozen steps: reverse a word, spell it in capitals, count
its letters, add two small numbers, name the next letter, name an opposite. Each record is
``{"prompt": ..., "completion": ...}``, the prompt a task name, a colon, the argument and a
newline; with the built-in byte-level tokenizer every record fits ``--seq-len 64``.
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "integration" / "assets" / "instructions" / "tiny.jsonl"
SEED = 13

# Short everyday words, for reversing, capitals and counting.
WORDS = (
    "apple bread chair dance eagle field grape house igloo juice kite lemon "
    "money night ocean pencil queen river stone table uncle voice water yellow "
    "zebra bottle candle dragon garden hammer island jacket ladder market number "
    "orange planet rabbit silver ticket window basket button castle doctor flower "
    "forest guitar kitten mirror pepper rocket school spider summer tiger turtle "
    "violin wallet winter yogurt"
).split()

# Opposites, used in both directions.
OPPOSITES = (
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("fast", "slow"),
    ("open", "closed"),
    ("day", "night"),
    ("happy", "sad"),
    ("light", "dark"),
    ("early", "late"),
    ("full", "empty"),
    ("hard", "soft"),
    ("high", "low"),
    ("in", "out"),
    ("left", "right"),
    ("long", "short"),
    ("loud", "quiet"),
    ("new", "old"),
    ("rich", "poor"),
    ("strong", "weak"),
    ("wet", "dry"),
    ("win", "lose"),
    ("young", "old"),
    ("near", "far"),
    ("push", "pull"),
    ("buy", "sell"),
    ("first", "last"),
    ("thick", "thin"),
    ("heavy", "light"),
    ("clean", "dirty"),
    ("true", "false"),
)


def _records(rng: random.Random) -> list[tuple[str, str]]:
    """(prompt, completion) pairs of every task, in task order."""
    pairs: list[tuple[str, str]] = []
    for word in WORDS:
        pairs.append((f"Reverse: {word}\n", word[::-1]))
        pairs.append((f"Capitals: {word}\n", word.upper()))
        pairs.append((f"Letters in: {word}\n", str(len(word))))
    # 100 distinct sums of two numbers below 50.
    for x, y in rng.sample([(x, y) for x in range(50) for y in range(50)], 100):
        pairs.append((f"Add: {x} + {y}\n", str(x + y)))
    letters = string.ascii_lowercase
    for here, after in zip(letters, letters[1:], strict=False):
        pairs.append((f"Next letter: {here}\n", after))
    for a, b in OPPOSITES:
        pairs.append((f"Opposite: {a}\n", b))
        # "old" and "light" have two opposites here: keep each prompt's answer unique.
        if b not in ("old", "light"):
            pairs.append((f"Opposite: {b}\n", a))
    return pairs


def lines() -> list[str]:
    """The file's lines: every record once, in a seeded shuffle."""
    rng = random.Random(SEED)
    pairs = _records(rng)
    rng.shuffle(pairs)
    return [json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines()), encoding="utf-8")
    print(f"wrote {len(lines())} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
