"""What the suite needs from the machine, and what a test does when it is missing.

etcd (Debian's ``etcd-server``: the etcd store and the coordinator restarted over it),
network namespaces (root and ``ip``: the cluster tests) and a tmpfs mount (root: the full
disk test). ``launch/test.sh`` installs etcd where it can. A test whose component is
missing fails, naming it and how to get it, unless the user asked to skip it
(``SPOTLINE_ALLOW_SKIP=etcd,netns,tmpfs``, or ``all``): a skip would let the test command
pass without the tests that check what the README claims.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

ALLOW_ENV = "SPOTLINE_ALLOW_SKIP"
COMPONENTS = ("etcd", "netns", "tmpfs")


def allowed_skips() -> set[str]:
    """The components the user asked to skip (``SPOTLINE_ALLOW_SKIP``)."""
    named = {c.strip() for c in os.environ.get(ALLOW_ENV, "").split(",") if c.strip()}
    return set(COMPONENTS) if "all" in named else named


def missing(component: str, reason: str) -> NoReturn:
    """``component`` is missing here (``reason``: what and how to get it): a skip if the
    user allowed it, else a failure saying how to allow it."""
    assert component in COMPONENTS, component
    if component in allowed_skips():
        pytest.skip(reason)
    pytest.fail(f"{reason} (or set {ALLOW_ENV}={component} to skip what needs it)", pytrace=False)
