"""Helpers for the control-plane tests: a bus factory over both buses, broker-side connection
closing, and a tiny node process that registers and waits for START.

Imported by tests/*/test_control_*.py (tests/ is on sys.path through tests/conftest.py).
Run as a script it is the node process of the restart test:

    python tests/control_helpers.py --bus embedded --session s --node-id o0 --role owner --incarnation 1
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # when run as a script
    sys.path.insert(0, str(REPO))

from splitlab.control.bus import ControlBus, make_bus  # noqa: E402
from splitlab.control.embedded import EmbeddedAddress, EmbeddedBusServer  # noqa: E402
from splitlab.errors import PeerLostError  # noqa: E402

BROKER_URL = os.environ.get("SPLITLAB_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
BUS_KINDS = [
    pytest.param("embedded", id="embedded"),
    pytest.param("rabbitmq", id="rabbitmq", marks=pytest.mark.rabbitmq),
]


def unique_session() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@dataclass
class BusFactory:
    """Opens buses of one kind for one test session; `teardown` closes them and deletes
    exactly the queues of the sessions it used."""

    kind: str
    session: str = field(default_factory=unique_session)
    server: EmbeddedBusServer | None = None
    buses: list[ControlBus] = field(default_factory=list)
    used: dict[str, set[str]] = field(default_factory=dict)  # session -> node ids

    def __post_init__(self) -> None:
        if self.kind == "embedded":
            self.server = EmbeddedBusServer()
            self.server.start()

    def connect_kwargs(self, session: str, node_id: str) -> dict[str, object]:
        if self.kind == "rabbitmq":
            return {"url": BROKER_URL, "session": session, "node_id": node_id}
        assert self.server is not None
        a = self.server.address
        return {
            "host": a.host,
            "port": a.port,
            "authkey": a.authkey,
            "session": session,
            "node_id": node_id,
        }

    def open(self, node_id: str, *, session: str | None = None, **kwargs: object) -> ControlBus:
        session = session or self.session
        bus = make_bus(self.kind, **self.connect_kwargs(session, node_id), **kwargs)
        self.used.setdefault(session, set()).add(node_id)
        self.buses.append(bus)
        return bus

    def teardown(self) -> None:
        for bus in self.buses:
            try:
                bus.cleanup()  # own queue and every queue it published to
            except PeerLostError:
                pass  # closed or lost: the sweep below covers its own queue
            bus.close()
        if self.server is not None:
            self.server.close()  # an embedded host forgets every queue it held
            return
        for session, node_ids in self.used.items():
            sweeper = make_bus(self.kind, **self.connect_kwargs(session, "cleanup"))
            sweeper.cleanup(node_ids)
            sweeper.close()


def open_buses(kind: str) -> Iterator[BusFactory]:
    """Body of a `buses` fixture: `yield from open_buses(request.param)`."""
    factory = BusFactory(kind)
    try:
        yield factory
    finally:
        factory.teardown()


@functools.cache
def _rabbitmqctl_problem() -> str | None:
    """Why `rabbitmqctl` cannot administer the local broker, or None (asked once: each call
    starts an Erlang VM, ~1 s)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        return "rabbitmqctl is not installed (it comes with rabbitmq-server)"
    done = subprocess.run([ctl, "-q", "list_vhosts"], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    if done.returncode != 0:
        return f"rabbitmqctl cannot administer the broker: {done.stderr.strip()[-200:]}"
    return None


def require_rabbitmqctl() -> None:
    """Skip unless `rabbitmqctl` can administer the local broker (node users, closing
    connections: root or the rabbitmq user); fail instead under SPLITLAB_REQUIRE_BROKER=1."""
    problem = _rabbitmqctl_problem()
    if problem is None:
        return
    if os.environ.get("SPLITLAB_REQUIRE_BROKER") == "1":  # CI runs as root with the broker
        pytest.fail(problem + " and SPLITLAB_REQUIRE_BROKER=1", pytrace=False)
    pytest.skip(problem)


def close_broker_connection(connection_name: str) -> None:
    """Have RabbitMQ itself close the connection named `connection_name` (rabbitmqctl)."""
    require_rabbitmqctl()
    ctl = shutil.which("rabbitmqctl")
    assert ctl is not None
    listing = subprocess.run(
        [ctl, "-q", "list_connections", "pid", "client_properties", "--no-table-headers"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    needle = f'{{"connection_name","{connection_name}"}}'
    for line in listing.stdout.splitlines():
        if needle in line:
            pid = line.split("\t", 1)[0]
            subprocess.run(
                [ctl, "-q", "close_connection", pid, "splitlab test"], timeout=60, check=True
            )
            return
    raise AssertionError(f"no broker connection named {connection_name!r}")


def node_command(
    factory: BusFactory, node_id: str, role: str, incarnation: int, port: int
) -> tuple[list[str], dict[str, str]]:
    """argv and env of a node process that registers with `coord` and waits for START."""
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--bus",
        factory.kind,
        "--session",
        factory.session,
    ]
    argv += [
        "--node-id",
        node_id,
        "--role",
        role,
        "--incarnation",
        str(incarnation),
        "--port",
        str(port),
    ]
    env = dict(os.environ)
    if factory.server is not None:
        env.update(factory.server.address.to_env())
    return argv, env


def _node_main() -> int:
    from splitlab.control.endpoint import ControlEndpoint
    from splitlab.control.messages import Kind, Register

    p = argparse.ArgumentParser()
    for name in ("--bus", "--session", "--node-id", "--role"):
        p.add_argument(name, required=True)
    p.add_argument("--incarnation", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    if args.bus == "embedded":
        a = EmbeddedAddress.from_env()
        kwargs: dict[str, object] = {"host": a.host, "port": a.port, "authkey": a.authkey}
    else:
        kwargs = {"url": BROKER_URL}
    ep = ControlEndpoint(make_bus(args.bus, session=args.session, node_id=args.node_id, **kwargs))
    register = Register(
        session_id=args.session,
        sender=args.node_id,
        role=args.role,
        host="127.0.0.1",
        port=args.port,
        incarnation=args.incarnation,
    )
    ep.send("coord", register)
    print("registered", flush=True)
    start = ep.wait_for((Kind.START,), 60.0)
    print(json.dumps({"start_roster": start.roster}), flush=True)  # type: ignore[attr-defined]
    ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(_node_main())
