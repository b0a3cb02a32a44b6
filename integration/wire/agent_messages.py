"""The messages between the coordinator and the machines' agents (``spotline.launch.agent``):
a machine's registration (:class:`MachineInfo`), the coordinator's answer to it
(:class:`Admission`) and its orders (:class:`Order`). Their store keys are spelled in
``spotline.wire.protocol``, with every other key. Pure: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args


@dataclass(frozen=True)
class MachineInfo:
    """A machine as its agent registers it: ``slots`` worker processes (one per GPU on a GPU
    machine), reachable by its peers at ``address`` (the agent's ``--address`` or its
    ``--iface``'s), where ``iface`` is the interface gloo binds to. ``probe_port`` is the
    agent's liveness port on ``address`` (it accepts and closes connections: a refused
    connect there proves the agent dead, see :mod:`spotline.launch.control.liveness_probe`)."""

    name: str
    slots: int
    address: str
    iface: str
    probe_port: int

    def __post_init__(self) -> None:
        assert self.slots >= 1, "a machine has at least one slot"
        assert self.name and "/" not in self.name, f"machine name {self.name!r}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slots": self.slots,
            "address": self.address,
            "iface": self.iface,
            "probe_port": self.probe_port,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> MachineInfo:
        return cls(
            str(raw["name"]),
            int(raw["slots"]),
            str(raw["address"]),
            str(raw["iface"]),
            int(raw["probe_port"]),
        )

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> MachineInfo:
        return cls.from_json(json.loads(text))


@dataclass(frozen=True)
class Admission:
    """The coordinator's answer to a machine's registration: admitted as ``machine``, or
    ``refused`` with the reason (one line, which the refused agent prints)."""

    machine: str | None = None
    refused: str | None = None

    def __post_init__(self) -> None:
        assert (self.machine is None) != (self.refused is None), "admitted or refused, not both"

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "refused": self.refused}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Admission:
        return cls(raw["machine"], raw["refused"])

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> Admission:
        return cls.from_json(json.loads(text))


OrderKind = Literal["start", "signal"]
Signal = Literal["kill", "term"]
"""``kill``: SIGKILL (a preemption without notice, or a hung worker); ``term``: SIGTERM (a
preemption notice: the worker leaves at the next step boundary)."""


@dataclass(frozen=True)
class Order:
    """The coordinator's order to one machine's agent: ``start`` worker ``worker`` (``python
    -m module *argv``), or send it ``signal``."""

    kind: OrderKind
    worker: str
    module: str = ""
    argv: tuple[str, ...] = ()
    signal: Signal | None = None

    def __post_init__(self) -> None:
        assert self.kind in get_args(OrderKind), self.kind
        assert (self.kind == "start") == bool(self.module), (
            "a start order, and only one, names a module"
        )
        assert (self.kind == "signal") == (self.signal in get_args(Signal)), (
            "a signal order names its signal"
        )

    @classmethod
    def start(cls, worker: str, module: str, argv: tuple[str, ...]) -> Order:
        return cls("start", worker, module, argv)

    @classmethod
    def send(cls, worker: str, signal: Signal) -> Order:
        return cls("signal", worker, signal=signal)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "worker": self.worker,
            "module": self.module,
            "argv": list(self.argv),
            "signal": self.signal,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Order:
        return cls(
            raw["kind"], str(raw["worker"]), str(raw["module"]), tuple(raw["argv"]), raw["signal"]
        )

    def encode(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def decode(cls, text: bytes | str) -> Order:
        return cls.from_json(json.loads(text))
