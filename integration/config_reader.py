"""The strict reader of a config section: a JSON object checked against a dataclass.

Every key must be a field of the dataclass and every value of its field's type (a Literal's
values, an optional's ``None``, a list's items, a nested section), else a
:class:`~spotline.errors.UserError` names the key path and the expected form: a typo that
silently fell back to a default would be the most expensive kind of bug on a cluster. Pure.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, Literal, TypeVar, Union

from spotline.errors import UserError

_T = TypeVar("_T")


def type_name(tp: Any) -> str:
    """What a value of type ``tp`` is, in words (the errors' and the config reference's)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is dict:
        return "an object"
    if origin is list:
        return f"a list of {type_name(typing.get_args(tp)[0])}"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


# What _converted returns for a value of the wrong type (None is a valid value).
_MISMATCH: Final = object()


def _check_value(path: str, value: Any, tp: Any) -> Any:
    """``value`` of config key ``path`` as its field type ``tp`` wants it (a section parsed,
    a float made of an int), or a UserError naming what was expected."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return _check_union(path, value, tp)
    checked = _converted(path, value, tp)
    if checked is _MISMATCH:
        raise UserError(f"config key '{path}' is {json.dumps(value)}; expected {type_name(tp)}")
    return checked


def _check_union(path: str, value: Any, tp: Any) -> Any:
    """The first arm of the union ``tp`` that accepts ``value``."""
    for arm in typing.get_args(tp):
        try:
            return _check_value(path, value, arm)
        except UserError:
            continue
    raise UserError(f"config key '{path}' is {json.dumps(value)}; expected {type_name(tp)}")


def _converted(path: str, value: Any, tp: Any) -> Any:
    """``value`` as the non-union type ``tp`` wants it, or ``_MISMATCH``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if value in typing.get_args(tp) else _MISMATCH
    if tp is type(None):
        return None if value is None else _MISMATCH
    if origin is dict:
        return dict(value) if isinstance(value, dict) else _MISMATCH
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if not isinstance(value, list):
            return _MISMATCH
        return [_check_value(f"{path}[{i}]", v, item_type) for i, v in enumerate(value)]
    if tp in (bool, int, float, str):
        return _scalar(value, tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_section(path, value, tp) if isinstance(value, dict) else _MISMATCH
    # A field type this parser does not know is a programming error.
    raise AssertionError(f"unsupported config field type {tp!r} at {path}")  # pragma: no cover


def _scalar(value: Any, tp: type) -> Any:
    """``value`` as the JSON scalar type ``tp`` (bool, int, float, str), or ``_MISMATCH``."""
    if isinstance(value, bool):
        # bool is an int subclass in Python; `true` for a count is a mistake, not 1.
        return value if tp is bool else _MISMATCH
    if tp is int:
        return value if isinstance(value, int) else _MISMATCH
    if tp is float:
        return float(value) if isinstance(value, (int, float)) else _MISMATCH
    if tp is str:
        return value if isinstance(value, str) else _MISMATCH
    return _MISMATCH  # tp is bool, value is not


def parse_section(path: str, raw: Mapping[str, Any], cls: type[_T]) -> _T:
    """``raw``, the JSON object at config key ``path``, as the dataclass ``cls``: every key a
    field of it and every value of its field's type, else a UserError naming the key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in hints:
            raise UserError(
                f"config key '{path}.{key}' is unknown; expected one of: {', '.join(names)}"
            )
        kwargs[key] = _check_value(f"{path}.{key}", value, hints[key])
    return cls(**kwargs)
