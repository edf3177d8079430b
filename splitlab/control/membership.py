"""Coordinator membership, pure: who registered, with which role, weight and data endpoint.

Nodes register with a stable node id. A node that restarts registers again with the same
id and a larger `incarnation`; that is accepted and replaces its endpoint (the predecessor
system counted registrations and rejected the restarted node as "too many clients").
A redelivered REGISTER of the same incarnation is a duplicate, and one of an older
incarnation comes from a dead predecessor: both change nothing. A new id beyond the
expected count of its role is rejected, naming the role and the ids already registered.

    .venv/bin/pytest tests/unit/test_control_membership.py -q
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from splitlab.control.messages import Register, Start
from splitlab.errors import ProtocolError

SESSION_KEY_BYTES = 32


def new_session_key_hex() -> str:
    """A fresh session key: 32 random bytes, hex-encoded (the launcher's, per run)."""
    return secrets.token_bytes(SESSION_KEY_BYTES).hex()


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    node_id: str
    role: str
    compute_weight: float
    host: str
    port: int
    incarnation: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeInfo:
        """Build from a roster entry; unknown keys are ignored."""
        try:
            return cls(
                node_id=str(data["node_id"]),
                role=str(data["role"]),
                compute_weight=float(data["compute_weight"]),
                host=str(data["host"]),
                port=int(data["port"]),
                incarnation=int(data["incarnation"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad roster entry {dict(data)!r}: {exc!r}") from None


class Outcome(StrEnum):
    NEW = "new"  # first registration of this id
    RESTARTED = "restarted"  # same id, newer incarnation: endpoint replaced
    DUPLICATE = "duplicate"  # same id and incarnation: nothing changes
    SUPERSEDED = "superseded"  # older incarnation than the one on record: ignored


class Membership:
    """Registrations of one session against the expected number of nodes per role."""

    def __init__(self, expected_by_role: Mapping[str, int]) -> None:
        for role, n in expected_by_role.items():
            if n < 0:
                raise ValueError(f"expected count of role {role!r} must be >= 0, got {n}")
        self.expected_by_role = dict(expected_by_role)
        self._nodes: dict[str, NodeInfo] = {}

    def register(self, msg: Register) -> Outcome:
        """Record one REGISTER; raises `ProtocolError` for an unknown role or one over capacity."""
        if msg.role not in self.expected_by_role:
            raise ProtocolError(
                f"node {msg.node_id!r} registered with role {msg.role!r}; "
                f"expected roles are {sorted(self.expected_by_role)}"
            )
        msg.check()  # weight and port ranges, as at decode (this REGISTER may be built here)
        info = NodeInfo(
            node_id=msg.node_id,
            role=msg.role,
            compute_weight=msg.compute_weight,
            host=msg.host,
            port=msg.port,
            incarnation=msg.incarnation,
        )
        known = self._nodes.get(msg.node_id)
        if known is not None:
            if known.role != msg.role:
                raise ProtocolError(
                    f"node {msg.node_id!r} registered as {known.role!r} and now as {msg.role!r}"
                )
            if msg.incarnation == known.incarnation:
                return Outcome.DUPLICATE
            if msg.incarnation < known.incarnation:
                return Outcome.SUPERSEDED
            self._nodes[msg.node_id] = info
            return Outcome.RESTARTED
        same_role = self.node_ids(msg.role)
        if len(same_role) >= self.expected_by_role[msg.role]:
            raise ProtocolError(
                f"node {msg.node_id!r}: all {self.expected_by_role[msg.role]} {msg.role!r} slots "
                f"are taken by {same_role}"
            )
        self._nodes[msg.node_id] = info
        return Outcome.NEW

    def node_ids(self, role: str | None = None) -> list[str]:
        """Registered ids (of one role), sorted, so rosters are deterministic."""
        return sorted(n.node_id for n in self._nodes.values() if role is None or n.role == role)

    def missing_by_role(self) -> dict[str, int]:
        return {
            role: n - len(self.node_ids(role))
            for role, n in self.expected_by_role.items()
            if n > len(self.node_ids(role))
        }

    @property
    def complete(self) -> bool:
        return not self.missing_by_role()

    def get(self, node_id: str) -> NodeInfo:
        return self._nodes[node_id]

    def roster(self) -> list[NodeInfo]:
        return [self._nodes[i] for i in self.node_ids()]

    def build_start(
        self,
        *,
        session_id: str,
        sender: str,
        round_id: int,
        plan: Mapping[str, Any],
    ) -> Start:
        """The START every node receives: session, round, plan and roster."""
        if not self.complete:
            raise ValueError(f"membership incomplete, missing {self.missing_by_role()}")
        return Start(
            session_id=session_id,
            sender=sender,
            round_id=round_id,
            plan=dict(plan),
            roster=[n.to_dict() for n in self.roster()],
        )
