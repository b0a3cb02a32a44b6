"""Fails when a DeepSpeed internal that Spotline overrides changes (see patches/)."""

from __future__ import annotations

import hashlib
import importlib
import inspect

import deepspeed
import pytest

from spotline.patches.deepspeed_seams import SEAMS, VERIFIED_VERSIONS


def _resolve(path: str):
    module_name, cls_name, attr = path.rsplit(".", 2)
    return getattr(getattr(importlib.import_module(module_name), cls_name), attr)


def test_installed_deepspeed_is_a_verified_version() -> None:
    assert deepspeed.__version__ in VERIFIED_VERSIONS


@pytest.mark.parametrize("symbol", sorted(SEAMS))
def test_overridden_deepspeed_source_is_unchanged(symbol: str) -> None:
    expected, relied_on = SEAMS[symbol]
    source = inspect.getsource(_resolve(symbol))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == expected, (
        f"{symbol} changed in DeepSpeed {deepspeed.__version__}; re-check: {relied_on}"
    )
