"""The pytest side of the namespace cluster (its core is spotline.launch.bench.netns, which
``spotline bench cluster`` uses too): ``cluster(n)`` that skips with the one reason line
where namespaces cannot be made, and the ``netns_cluster`` fixture.

``with cluster(n) as machines:`` makes a bridge in the root namespace and ``n`` namespaces,
each joined to it by a veth pair (``eth0`` with ``10.77.0.(i+1)/24`` inside); teardown always
kills every process the machines started and deletes everything it made.
"""

from __future__ import annotations

# Not used here: tests patch ``netns.os.geteuid`` (the os module itself, which the core reads).
import os  # noqa: F401
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import pytest
from components import missing

from spotline.launch.bench.netns import (  # noqa: F401  (re-exported for the tests)
    IFACE,
    PREFIX,
    Machine,
    NetnsUnavailable,
    our_names,
    sweep_leftovers,
)
from spotline.launch.bench.netns import cluster as _cluster


@contextmanager
def cluster(n: int) -> Iterator[list[Machine]]:
    """``n`` machines (namespaces) on one private bridge; everything removed on exit. A
    skip (one reason line) where the kernel or permissions refuse."""
    with ExitStack() as stack:
        try:
            machines = stack.enter_context(_cluster(n))
        except NetnsUnavailable as exc:
            missing("netns", str(exc))
        yield machines


@pytest.fixture
def netns_cluster() -> Iterator[Callable[[int], list[Machine]]]:
    """``netns_cluster(n) -> list[Machine]``: clusters torn down after the test."""
    with ExitStack() as stack:
        yield lambda n: stack.enter_context(cluster(n))
