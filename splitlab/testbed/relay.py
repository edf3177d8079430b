"""Loopback services of the root namespace (the broker) made reachable from testbed hosts.

A broker listening on 127.0.0.1 cannot be reached from inside a host's namespace. A `Relay`
listens on the testbed's root address and forwards each connection to the same port on
127.0.0.1, so a host dials `<root_address>:5672` and its bytes cross its shaped link like
any data; the broker sees a loopback client (RabbitMQ's `guest` user works as before).

This kernel has no netem, so a host's link delay is added here, in both directions, by the
same `wire.delay.DelayLine` that delays a transport's frames: `delays` maps a client's address
(its host's) to that host's one-way link delay, and each chunk is forwarded when it is due. A
message from host a through the broker to host b thus takes delay(a) + delay(b), as a data
frame from a to b does.

    .venv/bin/pytest tests/integration/test_testbed.py -q -k relay
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Mapping

from splitlab.wire.delay import DelayLine, PathDelay, sendall_through

log = logging.getLogger(__name__)

CHUNK = 64 << 10


def _pump(src: socket.socket, dst: socket.socket, delay: PathDelay | None = None) -> None:
    """Copy until `src` closes (each chunk `delay` late), then half-close `dst` so the other
    side sees the end."""
    line = DelayLine(default=delay) if delay is not None else None
    forward = sendall_through(line, dst.sendall, "relay")
    try:
        while data := src.recv(CHUNK):
            forward(data)
    except OSError:
        pass
    finally:
        if line is not None:  # what is on its way still arrives, when due
            line.close(drain_timeout_s=1.0 + 2 * (delay.delay_ms + delay.jitter_ms) / 1e3)
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


class Relay:
    """Forward `listen_host:port` to `target_host:port` (see module docstring)."""

    def __init__(self, listen_host: str, port: int, *, target_host: str = "127.0.0.1",
                 delays: Mapping[str, PathDelay] | None = None) -> None:  # fmt: skip
        self.port, self.target = port, (target_host, port)
        self.delays = dict(delays or {})  # client address -> its host's one-way link delay
        self._listener = socket.create_server((listen_host, port))
        self._listener.settimeout(0.25)
        self._closed = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name=f"relay-{port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, (client_host, *_) = self._listener.accept()
            except OSError:  # timeout tick, or closed
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError as exc:
                log.warning("relay %d: %s:%d refused: %s", self.port, *self.target, exc)
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._socks += [client, upstream]
            ends = threading.Barrier(2, action=lambda c=client, u=upstream: self._drop(c, u))
            delay = self.delays.get(client_host)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b, ends, delay), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, ends: threading.Barrier,
              delay: PathDelay | None) -> None:  # fmt: skip
        _pump(a, b, delay)
        try:
            ends.wait(timeout=3600)  # the second direction to finish closes the pair
        except threading.BrokenBarrierError:
            pass

    def _drop(self, *socks: socket.socket) -> None:
        with self._lock:
            self._socks = [s for s in self._socks if s not in socks]
        for s in socks:
            s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
