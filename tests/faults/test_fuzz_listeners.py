"""tests/faults: hostile input against the real listeners, bounded so it runs in CI.

Each test here throws inputs that a buggy, broken or malicious peer could send at a real
listener over real sockets and asserts the listener refuses it, closes the connection (no
hang) and still serves a legitimate client afterwards. This file drives the three network
listeners (`data`: a TcpTransport, `bus`: the EmbeddedBusServer, `ctrl`: a ring head's
control lane) with hypothesis over the input families of `tools/fuzz_listeners.py`, in
process as the wire tests do; the tool itself runs 10,000 inputs per listener in a child
process and measures RSS, threads and fds.

    .venv/bin/pytest tests/faults -q
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import fuzz_listeners as fz  # noqa: E402

from splitlab.control.embedded import EmbeddedBusServer  # noqa: E402
from splitlab.wire.frame import Lane  # noqa: E402
from splitlab.wire.tcp import TcpTransport  # noqa: E402

EXAMPLES = 30  # per listener; each example is one connection and one legitimate exchange


class _Host:
    """One listener in this process, its lanes drained as a stage drains them."""

    def __init__(self, listener: str) -> None:
        self.listener, self.delivered = listener, Counter()
        self.stop = threading.Event()
        self.server: EmbeddedBusServer | None = None
        self.transport: TcpTransport | None = None
        if listener == "bus":
            self.server = EmbeddedBusServer(authkey=fz.KEY)
            self.address: tuple[str, int] = (self.server.start().host, self.server.address.port)
            return
        self.transport = TcpTransport(fz.SERVER_ID[listener], key=fz.KEY, session=fz.SESSION,
                                      stall_timeout_s=2.0, handshake_timeout_s=2.0)  # fmt: skip
        self.address = self.transport.address
        for lane in [Lane.CONTROL] if listener == "ctrl" else list(Lane):
            threading.Thread(target=fz._drain, daemon=True,
                             args=(self.transport, lane, listener, self.stop, self.delivered),
                             ).start()  # fmt: skip

    def close(self) -> None:
        self.stop.set()
        if self.server is not None:
            self.server.close()
        if self.transport is not None:
            self.transport.close(drain_timeout_s=0)


@pytest.fixture(scope="module", params=fz.LISTENERS)
def host(request: Any) -> Iterator[_Host]:
    logging.getLogger("splitlab").setLevel(logging.ERROR)  # each refusal logs a warning
    h = _Host(request.param)
    try:
        yield h
    finally:
        h.close()
        logging.getLogger("splitlab").setLevel(logging.NOTSET)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(family=st.sampled_from(fz.FAMILIES), seed=st.integers(0, 2**32 - 1))
def test_malformed_input_is_refused_and_the_listener_still_serves(
    host: _Host, family: str, seed: int
) -> None:
    import random

    inp = fz.make_input(host.listener, family, random.Random(seed))
    outcome, accepted = fz.send_input(host.address, host.listener, inp, f"hyp{seed}-{family}")
    assert outcome == "closed", f"{family} (seed {seed}): the listener did not close: {outcome}"
    if family not in fz.MAY_DELIVER[host.listener]:
        got = accepted + host.delivered[family]
        assert got == 0, f"{family} (seed {seed}) reached the {host.listener} application"
    assert fz.legit_served(host.listener, host.address), f"not served after {family} ({seed})"
