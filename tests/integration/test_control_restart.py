"""A node process killed mid-membership restarts, re-registers with its id and is accepted.

SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_control_restart.py -q
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from control_helpers import BUS_KINDS, BusFactory, node_command, open_buses

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.membership import Membership, NodeInfo, Outcome
from splitlab.control.messages import Kind, Register


@pytest.fixture(params=BUS_KINDS)
def buses(request: pytest.FixtureRequest) -> Iterator[BusFactory]:
    yield from open_buses(request.param)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _spawn(
    buses: BusFactory, procs: list, node_id: str, role: str, incarnation: int, port: int
) -> subprocess.Popen[str]:
    argv, env = node_command(buses, node_id, role, incarnation, port)
    p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    buses.used.setdefault(buses.session, set()).add(node_id)
    return p


def _register(coord: ControlEndpoint, members: Membership) -> tuple[Register, Outcome]:
    msg = coord.wait_for((Kind.REGISTER,), 20.0)
    assert isinstance(msg, Register)
    return msg, members.register(msg)


def test_node_restarted_mid_membership_is_accepted_and_gets_start(
    buses: BusFactory, procs: list
) -> None:
    # Prepare: the coordinator expects one owner and one worker.
    coord = ControlEndpoint(buses.open("coord"))
    members = Membership({"owner": 1, "worker": 1})
    first = _spawn(buses, procs, "o0", "owner", incarnation=1, port=21000)
    assert _register(coord, members)[1] is Outcome.NEW
    # Execute: the owner dies before the worker arrives, and comes back.
    first.kill()
    first.wait(timeout=10)
    second = _spawn(buses, procs, "o0", "owner", incarnation=2, port=21001)
    restarted = _register(coord, members)
    worker = _spawn(buses, procs, "w0", "worker", incarnation=1, port=22000)
    joined = _register(coord, members)
    start = members.build_start(
        session_id=buses.session,
        sender="coord",
        round_id=0,
        plan={},
    )
    coord.send_all(members.node_ids(), start)
    # Assert: accepted as a restart, and both live nodes start with its new endpoint.
    assert restarted[1] is Outcome.RESTARTED and joined[1] is Outcome.NEW
    for p in (second, worker):
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        roster = [NodeInfo.from_dict(n) for n in json.loads(out.splitlines()[-1])["start_roster"]]
        assert {n.node_id: n.port for n in roster} == {"o0": 21001, "w0": 22000}
