"""Training's receive: a frame's tensors kept past its release, on the device they are used on.

.venv/bin/pytest tests/integration/test_train_receive.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from splitlab.train.protocol import owned_on
from splitlab.wire.frame import Lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not a package yet
from wire_helpers import tcp_transport  # noqa: E402


def _devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", _devices())
def test_owned_tensors_outlive_the_pooled_buffer_they_came_in(device: str) -> None:
    a = tcp_transport("a", "127.0.0.2")
    b = tcp_transport("b", "127.0.0.3")
    try:
        a.connect("b", *b.address, timeout_s=5)
        first = {"h": torch.arange(12.0).view(3, 4), "m": torch.ones(3, dtype=torch.bool)}
        a.send("b", Lane.ACTIVATION, "x", first).wait(5)
        with b.recv(Lane.ACTIVATION, timeout_s=5) as msg:
            pooled = msg.tensors["h"]
            kept = owned_on(msg, b, torch.device(device))
        # the same shapes come again into the same pooled buffers
        a.send("b", Lane.ACTIVATION, "x", {k: torch.zeros_like(t) for k, t in first.items()})
        with b.recv(Lane.ACTIVATION, timeout_s=5) as again:
            assert again.tensors["h"].data_ptr() == pooled.data_ptr()
            assert kept["h"].device.type == device and kept["m"].dtype is torch.bool
            assert torch.equal(kept["h"].cpu(), first["h"])
            assert torch.equal(kept["m"].cpu(), first["m"])
    finally:
        a.close(drain_timeout_s=0)
        b.close(drain_timeout_s=0)
