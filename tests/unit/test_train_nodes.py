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


def one_step(owner: OwnerNode, worker: WorkerNode) -> tuple[dict, dict, float]:
    """One microbatch through both nodes: (crossing sent, gradients returned, loss)."""
    batch = padded_batch("gpt2")
    hidden = owner.front_forward(0, batch)
    out = worker.body_forward(("o0", 0), hidden, batch[PAD_MASK])
    grad, loss = owner.tail_step(0, out, batch, scale=1.0)
    back = worker.body_backward(("o0", 0), grad)
    owner.front_backward(0, back)
    return {**hidden, **out}, {**grad, **back}, loss


def test_bf16_autocast_keeps_the_wire_and_the_weights_fp32_and_stays_close() -> None:
    torch.manual_seed(0)
    ref_owner, ref_worker = nodes()
    torch.manual_seed(0)
    owner, worker = nodes()
    owner.compute_dtype = worker.compute_dtype = torch.bfloat16

    sent_ref, grads_ref, loss_ref = one_step(ref_owner, ref_worker)
    sent, grads, loss = one_step(owner, worker)

    for name, tensor in {**sent, **grads}.items():
        assert tensor.dtype == torch.float32, name
    assert all(p.dtype == torch.float32 for p in owner.params + worker.params)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in owner.params)
    assert loss != loss_ref  # it did compute in bf16
    assert loss == pytest.approx(loss_ref, rel=0.05)
    for name, tensor in sent.items():
        assert torch.allclose(tensor, sent_ref[name], atol=0.1, rtol=0.05), name
