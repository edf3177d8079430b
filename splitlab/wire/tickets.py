"""Send completion tickets, without torch: the control plane and the delay line wait on them.

.venv/bin/pytest tests/unit/test_wire_blobs.py -q
"""

from __future__ import annotations

import threading

from splitlab.errors import WaitTimeoutError

DEFAULT_TIMEOUT_S = 30.0


class SendTicket:
    """Completion of one send; `wait` re-raises the sender's error (e.g. PeerLostError)."""

    __slots__ = ("_event", "_error")

    def __init__(self, *, done: bool = False) -> None:
        self._event: threading.Event | None = None if done else threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        if self._event is not None:
            self._event.set()

    def done(self) -> bool:
        return self._event is None or self._event.is_set()

    def wait(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if self._event is not None and not self._event.wait(timeout_s):
            raise WaitTimeoutError(f"send not finished within timeout_s={timeout_s}")
        if self._error is not None:
            raise self._error


SENT = SendTicket(done=True)  # shared ticket for sends finished before `send` returned
