"""The coordinator refuses a bad UPDATE over a real embedded bus, naming the node and the
field, and aborts the run (issue 18 F8): NaN weights even at zero samples, a negative count.

    .venv/bin/pytest tests/integration/test_train_coordinator_guard.py -q
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from control_helpers import BusFactory, open_buses

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Kind, Update
from splitlab.errors import AbortedError, NonFiniteError, ProtocolError
from splitlab.train.coordinator import Coordinator, encode_state


@pytest.fixture
def buses() -> Iterator[BusFactory]:
    yield from open_buses("embedded")


@pytest.mark.parametrize(
    ("num_samples", "weight", "error", "match"),
    [
        (0, float("nan"), NonFiniteError, "update from 'o0', key 'w'"),
        (-5, 1.0, ProtocolError, "update: field 'num_samples' = -5"),
    ],
    ids=["nan-weights-zero-samples", "negative-samples"],
)
def test_a_bad_update_is_refused_naming_it_and_the_run_aborts(
    buses: BusFactory, num_samples: int, weight: float, error: type, match: str
) -> None:
    errors: list[BaseException] = []

    def coordinate() -> None:  # a bus belongs to the thread that opened it
        ctl = ControlEndpoint(buses.open("coordinator"))
        try:
            Coordinator(control=ctl, owners=["o0"], workers=[], num_windows=1,
                        timeout_s=10.0).run(rounds=1)  # fmt: skip
        except BaseException as exc:
            errors.append(exc)
        finally:
            ctl.close()

    thread = threading.Thread(target=coordinate)
    thread.start()
    node = ControlEndpoint(buses.open("o0"), peers=["o0", "coordinator"])
    start = node.wait_for((Kind.START,), timeout_s=10.0)
    node.send("coordinator", Update(
        session_id=buses.session, sender="o0", round_id=0, num_samples=num_samples,
        partition="owner", weights=encode_state({"w": torch.full((2,), weight)}),
    ))  # fmt: skip
    thread.join(timeout=20.0)

    assert start.sender == "coordinator" and not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], error), errors
    assert match in str(errors[0])
    with pytest.raises(AbortedError, match="'coordinator'"):
        node.wait_for((Kind.UPDATE,), timeout_s=10.0)
