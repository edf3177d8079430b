"""Accept loops under pressure: the handshake cap and the backoff at fd exhaustion (wire/accept.py).

Real listeners (the TCP data plane and the embedded control bus) and real sockets; the fd
exhaustion runs in a child process whose RLIMIT_NOFILE is lowered until `accept` fails.

.venv/bin/pytest tests/integration/test_wire_accept.py -q
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from splitlab.control.embedded import EmbeddedBus, EmbeddedBusServer
from splitlab.wire.frame import Lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import tcp_transport  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


def _closed_at_once(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (TimeoutError, OSError) as exc:
        return not isinstance(exc, TimeoutError)


def test_bus_sheds_connections_beyond_the_handshake_cap(caplog: pytest.LogCaptureFixture) -> None:
    server = EmbeddedBusServer()
    server.max_handshakes = 8
    address = server.start()
    socks: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger="splitlab.wire.accept"):
            socks = _idle(address.port, 40)
            time.sleep(0.5)
            assert _threads("embedded-bus-conn") == 8  # 32 idle strangers pin no thread
            for s in socks[-5:]:
                s.settimeout(2.0)
                assert _closed_at_once(s)
        assert server._acceptor is not None and server._acceptor.shed == 32
        shed_logs = [r for r in caplog.records if "cap" in r.getMessage()]
        assert len(shed_logs) == 1  # once per burst, not per connection
        for s in socks:
            s.close()
        deadline = time.monotonic() + 5
        bus = None
        while bus is None:  # the server frees the slots as it sees the strangers leave
            try:
                bus = EmbeddedBus.connect(host=address.host, port=address.port,
                                          authkey=address.authkey, session="s", node_id="n",
                                          timeout_s=2.0)  # fmt: skip
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        bus.close()
    finally:
        for s in socks:
            s.close()
        server.close()


def test_data_plane_sheds_connections_beyond_the_handshake_cap() -> None:
    b = tcp_transport("b", "127.0.0.1", max_handshakes=4)
    socks: list[socket.socket] = []
    try:
        socks = _idle(b.address[1], 20)
        time.sleep(0.5)
        assert _threads("wire-b-conn") == 4
        assert b._acceptor.shed == 16 and b.counters()["accept_shed"] == 16  # in its traces too
        for s in socks:
            s.close()
        time.sleep(0.5)
        a = tcp_transport("a", "127.0.0.1")
        try:
            a.connect("b", *b.address, timeout_s=5)
            assert b.counters()["auth_ok"] == len(Lane)
        finally:
            a.close(drain_timeout_s=0)
    finally:
        for s in socks:
            s.close()
        b.close(drain_timeout_s=0)


_CHILD = """
import os, resource, sys
from splitlab.control.embedded import EmbeddedBusServer
server = EmbeddedBusServer()
address = server.start()
n = len(os.listdir('/proc/self/fd'))
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
print(address.port, address.authkey.hex(), flush=True)
sys.stdin.readline()  # the parent measured: free the descriptors
for fd in held:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
server.close()
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_accept_loop_backs_off_at_fd_exhaustion_and_recovers() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    try:
        port_text, key_hex = child.stdout.readline().split()
        port = int(port_text)
        pending = socket.create_connection(("127.0.0.1", port), timeout=5)  # accept: EMFILE
        time.sleep(0.3)
        cpu0, t0 = _cpu_s(child.pid), time.monotonic()
        time.sleep(2.0)
        busy = (_cpu_s(child.pid) - cpu0) / (time.monotonic() - t0)
        assert busy < 0.10, f"accept loop at EMFILE used {busy:.0%} of a core"
        pending.close()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "freed"
        bus = EmbeddedBus.connect(host="127.0.0.1", port=port, authkey=bytes.fromhex(key_hex),
                                  session="s", node_id="n", timeout_s=5.0)  # fmt: skip
        bus.close()  # the loop accepts again once descriptors are free
        child.stdin.write("\n")
        child.stdin.flush()
        _, err = child.communicate(timeout=10)
        assert "backing off" in err and err.count("cannot accept") == 1
    finally:
        child.kill()
        child.wait()
