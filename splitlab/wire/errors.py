"""Typed errors of the tensor data plane, each naming the offending field and value.

Every one derives from the process-level errors in `splitlab.errors`, so a process that dies of
one exits with the matching code (protocol, peer lost, timeout, non-finite).

    .venv/bin/pytest tests/unit/test_wire_frame.py -q
"""

from __future__ import annotations

from typing import Any

from splitlab.errors import ExitCode, NonFiniteError, ProtocolError, WaitTimeoutError

_MAX_VALUE_REPR = 80


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_REPR else text[: _MAX_VALUE_REPR - 3] + "..."


class FrameError(ProtocolError):
    """A frame violates the wire format; `field` and `value` say where and what."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"bad frame: field {field!r} = {_short(value)}: {reason}")


class TruncatedFrameError(FrameError):
    """The byte stream ended inside a frame (a socket reader maps this to PeerLostError)."""


class PeerClosedError(TruncatedFrameError):
    """The peer closed the stream between frames (EOF with no byte of a next frame read): an
    orderly goodbye, still a lost peer to anyone waiting on it, but not a fault to warn about."""


class NonFiniteFrameError(FrameError, NonFiniteError):
    """A floating-point tensor carried NaN or Inf while finiteness was asked for."""

    exit_code = ExitCode.NON_FINITE


class AuthError(ProtocolError):
    """The data-connection handshake was refused (wrong key, replay, wrong session)."""


class PoolExhaustedError(WaitTimeoutError):
    """A buffer pool could not lend `needed_bytes` within its budget before the timeout."""

    def __init__(self, pool: str, needed_bytes: int, pool_bytes: int, timeout_s: float) -> None:
        self.pool, self.needed_bytes, self.pool_bytes = pool, needed_bytes, pool_bytes
        super().__init__(
            f"buffer pool {pool!r} exhausted: {needed_bytes} bytes needed, budget "
            f"pool_bytes={pool_bytes}, nothing released within timeout_s={timeout_s}; "
            "release message leases sooner or raise pool_bytes"
        )
