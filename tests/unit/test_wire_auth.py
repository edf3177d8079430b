"""Pure parts of the handshake: proofs bind every transcript field; the replay guard is bounded.

.venv/bin/pytest tests/unit/test_wire_auth.py -q
"""

from __future__ import annotations

import pytest

from splitlab.wire.auth import ReplayGuard, proof

IDS = dict(
    session="s", client_id="a", server_id="b", lane="activation", client_nonce="c", server_nonce="n"
)


@pytest.mark.parametrize("field", sorted(IDS))
def test_proof_changes_with_every_transcript_field(field: str) -> None:
    assert proof(b"k", "client", **IDS) != proof(b"k", "client", **(IDS | {field: "other"}))


def test_client_and_server_proofs_differ() -> None:
    assert proof(b"k", "client", **IDS) != proof(b"k", "server", **IDS)


def test_replay_guard_refuses_a_seen_nonce_and_forgets_the_oldest() -> None:
    guard = ReplayGuard(max_nonces=2)
    assert guard.first_use("x") and not guard.first_use("x")
    guard.first_use("y")
    guard.first_use("z")
    assert guard.first_use("x")
