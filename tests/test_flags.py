"""The flags that set config keys: one table (spotline.launch.flags.FLAGS) pairs each with
its config field, and each field without a flag is declared so (CONFIG_ONLY)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal

import pytest

from spotline.config import DEFAULT_DEEPSPEED, SpotlineConfig, load_config, with_overrides
from spotline.errors import UserError
from spotline.launch.flags import (
    CONFIG_ONLY,
    FLAG_KEYS,
    FLAGS,
    UsageErrorParser,
    add_recovery_flags,
    add_run_flags,
    key_type,
    overrides_from_args,
)
from spotline.launch.train_command import build_train_parser


def _spotline_keys() -> set[str]:
    """Every dotted key of the spotline section, read from the config's JSON form."""
    sections = dataclasses.asdict(SpotlineConfig())
    return {f"spotline.{name}.{key}" for name, section in sections.items() for key in section}


def test_every_config_key_has_a_flag_or_says_why_not_and_every_flag_sets_a_key() -> None:
    keys = _spotline_keys()
    assert "spotline.model.seq_len" in keys and len(keys) > 40  # the section was read
    flagged = {flag.key for flag in FLAGS if flag.key.startswith("spotline.")}
    deepspeed = {flag.key for flag in FLAGS} - flagged
    both = flagged & set(CONFIG_ONLY)
    assert not both, f"keys with a flag, also declared without one: {sorted(both)}"
    forgotten = keys - flagged - set(CONFIG_ONLY)
    assert not forgotten, f"config keys with neither a flag nor a reason: {sorted(forgotten)}"
    unknown = (flagged | set(CONFIG_ONLY)) - keys
    assert not unknown, f"flags or reasons that name no config key: {sorted(unknown)}"
    # A DeepSpeed key a flag sets is one of the (scalar) keys Spotline gives a default.
    assert deepspeed == {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}
    assert all(isinstance(DEFAULT_DEEPSPEED[key], int) for key in deepspeed)
    # One flag per key and per name: the mapping flag -> key is derived from the table.
    assert len({flag.key for flag in FLAGS}) == len({flag.name for flag in FLAGS}) == len(FLAGS)
    assert FLAG_KEYS == {flag.dest: flag.key for flag in FLAGS}
    assert all(reason for reason in CONFIG_ONLY.values())


def _argv_and_value(name: str, tp: Any) -> tuple[list[str], Any]:
    """Command-line words that give flag ``name`` a value of type ``tp``, and that value."""
    if tp is bool:
        return [name], True
    if typing.get_origin(tp) is list:
        return [name, "a", name, "b"], ["a", "b"]
    if typing.get_origin(tp) is Literal:
        last = typing.get_args(tp)[-1]
        return [name, last], last
    sample = {int: ("7", 7), float: ("0.25", 0.25), str: ("text", "text")}[tp]
    return [name, sample[0]], sample[1]


def test_every_flag_parses_to_its_key_with_the_fields_type() -> None:
    parser = argparse.ArgumentParser()
    build_train_parser(parser)
    argv: list[str] = []
    expected: dict[str, Any] = {}
    for flag in FLAGS:
        words, value = _argv_and_value(flag.name, key_type(flag.key))
        argv += words
        expected[flag.key] = value
    overrides = overrides_from_args(parser.parse_args(argv))
    assert overrides == expected
    assert [type(overrides[key]) for key in expected] == [type(v) for v in expected.values()]
    assert overrides_from_args(parser.parse_args([])) == {}


def test_a_flag_goes_through_the_config_parser_as_the_file_does() -> None:
    parser = argparse.ArgumentParser()
    build_train_parser(parser)
    args = parser.parse_args(["--eval-holdout", "0.25", "--deterministic", "--inject", "add:2"])
    cfg = with_overrides(load_config(None), overrides_from_args(args))
    assert cfg.spotline.evaluation.holdout_fraction == 0.25
    assert cfg.spotline.determinism.enabled is True
    assert cfg.spotline.recovery.inject == ["add:2"]
    # A boolean key's flag turns it off too (the default determinism is on).
    off = parser.parse_args(["--no-deterministic"])
    assert not with_overrides(
        load_config(None), overrides_from_args(off)
    ).spotline.determinism.enabled
    # A string flag has no argparse choices: the config parser names the key and the values.
    bad = overrides_from_args(parser.parse_args(["--redundancy", "sometimes"]))
    with pytest.raises(UserError, match="'spotline.redundancy.mode' is \"sometimes\"; expected"):
        with_overrides(load_config(None), bad)


def test_deepspeeds_launcher_takes_neither_worker_counts_nor_recovery_flags() -> None:
    launcher = argparse.ArgumentParser()
    add_run_flags(launcher, with_workers=False)
    spotline = argparse.ArgumentParser()
    add_run_flags(spotline, with_workers=True)
    add_recovery_flags(spotline)

    def names(parser: argparse.ArgumentParser) -> set[str]:
        # A boolean key's flag comes with its --no- form: one flag, the same key.
        options = {o for action in parser._actions for o in action.option_strings}
        return {o.replace("--no-", "--") for o in options} - {"-h", "--help"}

    assert names(spotline) == {flag.name for flag in FLAGS}
    assert names(launcher) == {flag.name for flag in FLAGS if flag.scope == "run"}
    assert {"--workers", "--start-workers", "--trace", "--inject"}.isdisjoint(names(launcher))


def test_one_usage_error_parser_for_every_command() -> None:
    from spotline.launch.bench.command import build_parser as bench_parser
    from spotline.launch.calibrate import build_parser as calibrate_parser
    from spotline.launch.simulate import build_parser as simulate_parser

    for build, argv, prog in (
        (calibrate_parser, ["--output", "o", "--steps", "x"], "spotline calibrate"),
        (simulate_parser, ["--nodes", "1"], "spotline simulate"),
        (bench_parser, ["foundation", "--steps", "x"], "spotline bench foundation"),
    ):
        parser = build()
        assert isinstance(parser, UsageErrorParser)
        with pytest.raises(UserError) as info:
            parser.parse_args(argv)
        assert str(info.value).endswith(f"; see {prog} --help"), str(info.value)
    with pytest.raises(UserError, match="argument --seq-len: invalid int value: 'x'"):
        parser = UsageErrorParser(prog="spotline train")
        add_run_flags(parser, with_workers=True)
        parser.parse_args(["--seq-len", "x"])
