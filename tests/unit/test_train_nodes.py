"""Node-side halves of the step: graphs kept until their backward, then released."""

from __future__ import annotations

import pytest
import torch
from model_helpers import padded_batch, tiny_model

from splitlab.errors import ProtocolError
from splitlab.models.families import PAD_MASK
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters


def nodes() -> tuple[OwnerNode, WorkerNode]:
    front, body, tail = build_parts(
        tiny_model("gpt2"), u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)
    )
    sgd = torch.optim.SGD
    return (
        OwnerNode("o0", front, tail, sgd(partition_parameters(front, tail), lr=0.1)),
        WorkerNode("w0", body, sgd(partition_parameters(body), lr=0.1)),
    )


def test_graphs_live_until_backward_then_released() -> None:
    owner, worker = nodes()
    batch = padded_batch("gpt2")

    hidden = owner.front_forward(7, batch)
    out = worker.body_forward(("o0", 7), hidden, batch[PAD_MASK])
    grad, loss = owner.tail_step(7, out, batch, scale=1.0)
    assert (owner.live, worker.live) == (1, 1)
    owner.front_backward(7, worker.body_backward(("o0", 7), grad))

    assert (owner.live, worker.live) == (0, 0)
    assert loss > 0 and worker.num_samples == owner.num_samples == 3
    assert worker.padded_tokens == batch[PAD_MASK].numel()


def test_second_backward_or_unknown_microbatch_is_a_protocol_error() -> None:
    owner, worker = nodes()

    with pytest.raises(ProtocolError, match="'w0' has no live graph"):
        worker.body_backward(("o0", 1), torch.zeros(3, 8, 32))
    with pytest.raises(ProtocolError, match="'o0' has no live graph"):
        owner.front_backward(1, torch.zeros(3, 8, 32))
