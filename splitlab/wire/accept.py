"""The accept loop of every listener that authenticates its peers (data plane, embedded bus).

`Acceptor` accepts connections and hands each to `handler(sock, done)` on its own thread.
Before the handshake proves the key a peer is a stranger, so strangers are bounded: at most
`max_handshakes` connections may be in their handshake at once (`done()` frees the slot once
it is over; the slot is freed anyway when the handler returns). A connection beyond the cap is
closed at once, so idle connections cannot pin a thread and a socket each; such refusals are
counted (`shed`, and `accept_shed` in the transport's counters) and logged once per burst,
not once per connection. When the process is out
of file descriptors (EMFILE/ENFILE, or the kernel out of buffers) `accept` fails at once with
the connection still pending, so the loop backs off (sleeps growing to `MAX_BACKOFF_S`) and
says so once per episode instead of spinning.

    .venv/bin/pytest tests/integration/test_wire_accept.py -q
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # counters import the buffer pools, hence torch: the bus must not pay for it
    from splitlab.wire.counters import WireCounters

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 64  # strangers at once per listener; a real peer's handshake takes ms
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.01, 1.0
# accept failures that mean "out of resources now, the connection is still pending"
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

Done = Callable[[], None]
Handler = Callable[[socket.socket, Done], None]


class Acceptor:
    """Accepts on `listener` until `close()`; see the module docstring."""

    def __init__(self, listener: socket.socket, handler: Handler, *, name: str,
                 max_handshakes: int = MAX_HANDSHAKES,
                 counters: WireCounters | None = None) -> None:  # fmt: skip
        if max_handshakes < 1:
            raise ValueError(f"max_handshakes must be >= 1, got {max_handshakes}")
        self.listener, self.handler, self.name = listener, handler, name
        self.max_handshakes = max_handshakes
        self.shed = 0  # connections closed at once because the handshake cap was reached
        self.exhausted = 0  # accept calls that failed for want of descriptors or buffers
        self.counters = counters  # the transport's, so a trace shows both as accept_* counters
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._handlers: list[threading.Thread] = []
        self._burst = 0  # connections shed since the last one admitted
        self._thread = threading.Thread(target=self._run, name=f"{name}-accept", daemon=True)

    def start(self) -> Acceptor:
        self._thread.start()
        return self

    def close(self, *, join_timeout_s: float = 5.0) -> None:
        """Stop accepting and close the listener; the handlers are joined by `join()`."""
        self._stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        if self._thread.ident is not None:
            self._thread.join(timeout=join_timeout_s)

    def join(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            handlers = list(self._handlers)
        for t in handlers:
            t.join(timeout=timeout_s)

    def _run(self) -> None:
        backoff_s = 0.0
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue  # a listener with a timeout: look at the stop flag
            except OSError as exc:
                if self._stop.is_set() or exc.errno not in _EXHAUSTED:
                    return  # closed
                self.exhausted += 1
                if self.counters is not None:
                    self.counters.add("accept_exhausted")
                if backoff_s == 0.0:
                    log.warning("%s: cannot accept (%s); backing off up to %.1f s until "
                                "descriptors free up", self.name, exc, MAX_BACKOFF_S)  # fmt: skip
                backoff_s = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, backoff_s * 2))
                self._stop.wait(backoff_s)
                continue
            if backoff_s:
                log.info("%s: accepting again after %d failed accepts", self.name, self.exhausted)
                backoff_s = 0.0
            if not self._slots.acquire(blocking=False):
                self._shed(sock)
                continue
            if self._burst:
                log.warning("%s: shed %d connections while %d handshakes were in progress",
                            self.name, self._burst, self.max_handshakes)  # fmt: skip
                self._burst = 0
            t = threading.Thread(target=self._serve, args=(sock,), name=f"{self.name}-conn",
                                 daemon=True)  # fmt: skip
            with self._lock:
                self._handlers = [h for h in self._handlers if h.is_alive()] + [t]
            t.start()

    def _shed(self, sock: socket.socket) -> None:
        self.shed += 1
        if self.counters is not None:
            self.counters.add("accept_shed")
        if self._burst == 0:
            log.warning("%s: %d handshakes in progress (the cap): closing new connections "
                        "until one ends", self.name, self.max_handshakes)  # fmt: skip
        self._burst += 1
        sock.close()

    def _serve(self, sock: socket.socket) -> None:
        freed = threading.Event()

        def done() -> None:
            with self._lock:
                if freed.is_set():
                    return
                freed.set()
            self._slots.release()

        try:
            self.handler(sock, done)
        finally:
            done()
