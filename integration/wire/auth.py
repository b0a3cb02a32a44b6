"""The job token: every value Spotline writes to the job's store is sealed with an HMAC.

The store itself authenticates nobody (torch's TCPStore has no authentication; an etcd
endpoint may be shared), so anyone who can reach the coordinator's port could register a
machine, forge a report or a plan, or order an agent to start a process. The job token
closes that: the coordinator is given one (``--token-file``) or generates one and writes it
to ``OUTPUT/job-token`` (mode 0600); agents get it with their own ``--token-file`` and hand
it to their workers in the environment (:data:`TOKEN_ENV`). A value is stored as
``<hmac>|<payload>``, the HMAC-SHA256 over the key and the payload (so that a sealed value
cannot be replayed under another key), and :class:`AuthStore` opens it on the way back: a
value whose seal does not verify is treated as never written, and ``on_forged`` is told.

What is not sealed: counters (``store.add``: a number cannot carry a seal; what they count is
sealed) and the process groups' rendezvous keys (``pg/<g>``), which torch reads and writes
itself. Someone on the network can still delete or overwrite keys (a denial of service,
as with any unauthenticated port): what they write is never acted on.

Pure: no torch (the coordinator's planning side and the tests use it alone).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from spotline.errors import UserError
from spotline.run_dir import TOKEN_NAME

TOKEN_ENV = "SPOTLINE_JOB_TOKEN"  # how an agent hands the token to its workers
_SEP = b"|"
_MAC_LEN = 64  # hex digits of a SHA-256


class RawStore(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def add(self, key: str, value: int) -> int: ...

    def num_keys(self) -> int: ...


class ForgedValue(LookupError):
    """A value whose seal does not verify with this job's token."""


@dataclass(frozen=True)
class JobToken:
    secret: bytes = field(repr=False)  # never printed

    def __post_init__(self) -> None:
        assert len(self.secret) >= 16, "a job token has at least 128 bits"

    @classmethod
    def generate(cls) -> JobToken:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_text(cls, text: str) -> JobToken:
        """ValueError unless ``text`` is at least 32 hex digits."""
        secret = bytes.fromhex(text.strip())
        if len(secret) < 16:
            raise ValueError("a job token has at least 32 hex digits")
        return cls(secret)

    def text(self) -> str:
        return self.secret.hex()

    def _mac(self, key: str, payload: bytes) -> bytes:
        return (
            hmac.new(self.secret, key.encode() + b"\0" + payload, hashlib.sha256)
            .hexdigest()
            .encode()
        )

    def seal(self, key: str, payload: str) -> str:
        return (self._mac(key, payload.encode()) + _SEP + payload.encode()).decode()

    def open(self, key: str, raw: bytes) -> bytes | None:
        """The payload of a value sealed for ``key`` with this token; None if it is not."""
        mac, sep, payload = raw.partition(_SEP)
        if not sep or len(mac) != _MAC_LEN:
            return None
        return payload if hmac.compare_digest(mac, self._mac(key, payload)) else None


def unsealed_payload(raw: bytes) -> bytes:
    """A value's payload without checking its seal (what a refused agent reads: its own
    token cannot verify the coordinator's answer)."""
    mac, sep, payload = raw.partition(_SEP)
    return payload if sep and len(mac) == _MAC_LEN else raw


def is_sealed(raw: bytes) -> bool:
    mac, sep, _ = raw.partition(_SEP)
    return bool(sep) and len(mac) == _MAC_LEN


class AuthStore:
    """The job's store with every value sealed on ``set`` and opened on ``get``/``check``.

    ``check`` is true only for keys whose values verify, so the usual ``check`` then ``get``
    reads a forged value as an absent one; ``get`` of a forged value raises
    :class:`ForgedValue`. ``add`` (counters) passes through. ``inner`` is the store itself,
    for what torch reads (a process group's rendezvous)."""

    def __init__(
        self,
        inner: RawStore,
        token: JobToken,
        on_forged: Callable[[str], None] | None = None,
    ) -> None:
        self.inner = inner
        self.token = token
        self.on_forged = on_forged

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, self.token.seal(key, value))

    def _open(self, key: str, raw: bytes) -> bytes | None:
        payload = self.token.open(key, raw)
        if payload is None and self.on_forged is not None:
            self.on_forged(key)
        return payload

    def get(self, key: str) -> bytes:
        payload = self._open(key, self.inner.get(key))
        if payload is None:
            raise ForgedValue(f"the value of {key!r} is not sealed with this job's token")
        return payload

    def check(self, keys: list[str]) -> bool:
        if not self.inner.check(keys):
            return False
        return all(self._open(k, self.inner.get(k)) is not None for k in keys)

    def read(self, key: str) -> bytes | None:
        """The value of ``key``, None if absent or forged: ``check`` then ``get`` in two
        round trips instead of three (the coordinator reads every worker's keys many times
        a second)."""
        if not self.inner.check([key]):
            return None
        return self._open(key, self.inner.get(key))

    def num_keys(self) -> int:
        """How many keys the store holds: a key added anywhere changes it (one round trip)."""
        return self.inner.num_keys()

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        # A forged value ends the wait too; the reader's get() then raises ForgedValue.
        self.inner.wait(keys, timeout)  # type: ignore[attr-defined]


def read_token_file(path: str | Path) -> JobToken:
    """A token file (hex, as the coordinator writes it); a UserError names what is wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise UserError(
            f"--token-file {p}: no such file; copy the coordinator's {TOKEN_NAME} (in its "
            "--output directory) to this machine"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--token-file {p}: cannot read it ({exc})") from None
    try:
        token = JobToken.from_text(text)
    except ValueError:
        raise UserError(
            f"--token-file {p}: not a job token (expected at least 32 hex digits, as the "
            f'coordinator writes to {TOKEN_NAME}); generate one with `python -c "import '
            'secrets; print(secrets.token_hex(32))"`'
        ) from None
    return token


def job_token(output: Path, token_file: str | None) -> JobToken:
    """The coordinator's token: the given file's, else the one in ``output`` from an earlier
    start (a restarted coordinator keeps its agents), else a new one written there with mode
    0600 (written whole, then renamed into place)."""
    if token_file is not None:
        return read_token_file(token_file)
    path = output / TOKEN_NAME
    if path.exists():
        return read_token_file(path)
    token = JobToken.generate()
    output.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{TOKEN_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token.text() + "\n")
    os.replace(tmp, path)
    return token
