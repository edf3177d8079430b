"""Two sides of a benchmark (client and server) as processes on two testbed hosts.

`pair_hosts` picks the hosts a link matters between: the first owner's (the edge) and the
first worker's (the server or cloud), so the path crosses the preset's shaped links.
`run_pair` starts the server, then the client, each inside its host (`Testbed.spawn`:
its namespace, cgroups and thread count), joined by a Unix socket pair whose ends they
receive as `--control-fd N`; it waits for the client, then the server, and kills whatever
is left on every exit path (the testbed's teardown would kill it too). The benchmark
speaks over that socket as over a pipe to a spawned child, so one benchmark body serves
both loopback and testbed runs; the control pipe crosses no namespace link, only the
measured traffic does.

    python tools/bench_transport.py --quick --testbed wifi_good     (as root)
"""

from __future__ import annotations

import socket
import subprocess

from splitlab.errors import ConfigError
from splitlab.testbed.netns import TestbedError
from splitlab.testbed.session import Testbed
from splitlab.testbed.topology import Topology

CONTROL_FD_FLAG = "--control-fd"


def pair_hosts(topology: Topology) -> tuple[str, str]:
    """(client host, server host): where owner rank 0 and worker rank 0 run."""
    client, server = topology.host_of("owner", 0), topology.host_of("worker", 0)
    if client == server:
        raise ConfigError(
            f"testbed {topology.name!r}: owner and worker both run on {client!r}, "
            "so no link lies between them"
        )
    return client, server


def _stop(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


def run_pair(tb: Testbed, *, client: tuple[str, list[str]], server: tuple[str, list[str]],
             timeout_s: float) -> int:  # fmt: skip
    """Run `server` = (host, argv) and `client` likewise (see module docstring); returns the
    client's exit status; a server that fails after a successful client is an error too."""
    ends = socket.socketpair()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for (host, argv), end in ((server, ends[1]), (client, ends[0])):
            fd = end.fileno()
            procs.append(tb.spawn(host, [*argv, CONTROL_FD_FLAG, str(fd)], pass_fds=[fd]))
        for end in ends:  # each side now holds its own copy: a dead side reads as EOF
            end.close()
        srv, cli = procs
        try:
            rc = cli.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TestbedError(
                f"testbed {tb.session}: the client on {client[0]} ran past {timeout_s} s"
            ) from None
        src = _stop(srv, 30.0)
        if rc == 0 and src != 0:
            raise TestbedError(f"testbed {tb.session}: the server on {server[0]} exited {src}")
        return rc
    finally:
        for end in ends:
            end.close()
        for proc in procs:
            if proc.poll() is None:
                _stop(proc, 0)
