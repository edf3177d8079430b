"""A node taking the coordinator's resume state (UPDATE "restore") over a real embedded bus:
a state that does not fit the node is refused naming the checkpoint file and the key, and
nothing is loaded.

    .venv/bin/pytest tests/integration/test_train_restore.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from control_helpers import BusFactory, open_buses
from torch import nn

from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Update
from splitlab.errors import AssetError
from splitlab.train.coordinator import RESTORE, encode_state, receive_merged


@pytest.fixture
def buses() -> Iterator[BusFactory]:
    yield from open_buses("embedded")


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"weight": torch.ones(1), "bias": torch.ones(2)}, r"'weight' has shape \[1\]"),
        ({"weight": torch.ones(2, 2)}, r"lacks keys \['bias'\]"),
    ],
    ids=["wrong-shape", "missing-key"],
)
def test_a_resume_state_that_does_not_fit_names_the_checkpoint_and_key(
    buses: BusFactory, state: dict[str, torch.Tensor], match: str
) -> None:
    coordinator = ControlEndpoint(buses.open("coordinator"))
    node = ControlEndpoint(buses.open("o0"))
    module = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    coordinator.send("o0", Update(
        session_id=buses.session, sender="coordinator", round_id=3, num_samples=0,
        partition=RESTORE, weights=encode_state(state),
    ))  # fmt: skip

    with pytest.raises(AssetError, match=rf"round-000004\.safetensors.*{match}"):
        receive_merged(node, [module], timeout_s=10.0)

    for key, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[key]), key
