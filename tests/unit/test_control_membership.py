"""Coordinator membership: register, restart by stable id, capacity, START building.

.venv/bin/pytest tests/unit/test_control_membership.py -q
"""

from __future__ import annotations

import pytest

from splitlab.control.membership import Membership, NodeInfo, Outcome, new_session_key_hex
from splitlab.control.messages import Register
from splitlab.errors import ProtocolError


def _reg(node: str, role: str = "owner", incarnation: int = 1, port: int = 20000) -> Register:
    return Register(
        session_id="s",
        sender=node,
        role=role,
        compute_weight=1.0,
        host="h",
        port=port,
        incarnation=incarnation,
    )


def _full() -> Membership:
    m = Membership({"owner": 2, "worker": 1})
    for r in (_reg("o0"), _reg("o1"), _reg("w0", "worker")):
        m.register(r)
    return m


def test_new_nodes_complete_the_membership() -> None:
    assert _full().complete


def test_missing_counts_per_role() -> None:
    m = Membership({"owner": 2, "worker": 1})
    m.register(_reg("o0"))
    assert m.missing_by_role() == {"owner": 1, "worker": 1}


def test_restarted_node_reregisters_and_is_accepted() -> None:
    m = Membership({"owner": 1})
    m.register(_reg("o0", incarnation=1, port=20000))
    assert m.register(_reg("o0", incarnation=2, port=20001)) is Outcome.RESTARTED
    assert m.get("o0").port == 20001 and m.complete


def test_restart_after_membership_is_complete_is_accepted() -> None:
    m = _full()
    assert m.register(_reg("w0", "worker", incarnation=5)) is Outcome.RESTARTED


def test_redelivered_register_is_a_duplicate() -> None:
    m = Membership({"owner": 1})
    m.register(_reg("o0"))
    assert m.register(_reg("o0")) is Outcome.DUPLICATE


def test_register_of_an_older_incarnation_changes_nothing() -> None:
    m = Membership({"owner": 1})
    m.register(_reg("o0", incarnation=3, port=1))
    assert m.register(_reg("o0", incarnation=2, port=2)) is Outcome.SUPERSEDED
    assert m.get("o0").port == 1


def test_new_id_over_capacity_is_rejected_naming_the_role() -> None:
    m = _full()
    with pytest.raises(ProtocolError, match="'owner' slots"):
        m.register(_reg("o9"))


def test_unknown_role_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="role 'stage'"):
        Membership({"owner": 1}).register(_reg("x", "stage"))


def test_role_change_under_the_same_id_is_rejected() -> None:
    m = Membership({"owner": 1, "worker": 1})
    m.register(_reg("n"))
    with pytest.raises(ProtocolError, match="now as 'worker'"):
        m.register(_reg("n", "worker", incarnation=2))


def test_non_positive_weight_is_rejected() -> None:
    bad = Register(session_id="s", sender="o0", role="owner", compute_weight=0.0)
    with pytest.raises(ProtocolError, match="compute_weight"):
        Membership({"owner": 1}).register(bad)


def test_start_carries_session_plan_and_sorted_roster_but_no_key() -> None:
    start = _full().build_start(session_id="s", sender="coord", round_id=0, plan={"w": 1})
    assert (start.session_id, start.plan) == ("s", {"w": 1})
    assert not any("key" in name for name in vars(start))  # each member derives it
    assert [NodeInfo.from_dict(n).node_id for n in start.roster] == ["o0", "o1", "w0"]


def test_start_needs_complete_membership() -> None:
    with pytest.raises(ValueError, match="missing"):
        Membership({"owner": 1}).build_start(session_id="s", sender="c", round_id=0, plan={})


def test_session_keys_are_32_random_bytes() -> None:
    a, b = new_session_key_hex(), new_session_key_hex()
    assert len(bytes.fromhex(a)) == 32 and a != b


def test_roster_entry_with_bad_field_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="roster"):
        NodeInfo.from_dict({"node_id": "x"})
