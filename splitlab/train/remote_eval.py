"""Validation at an owner whose body runs on a worker: forward only, before FedAvg.

The owner runs its front, sends the hidden state to one worker, the worker runs its body
under `no_grad` in eval mode (no graph, no dropout, nothing kept) and sends it back, and the
owner finishes with its tail and computes the metrics of `splitlab.train.validate` locally:
labels and logits never leave the owner. Workers answer these frames while they wait on the
control bus between rounds (`serve_validation` is their idle step).

    VAL_FORWARD  owner -> worker  activation lane  the front's crossing (hidden_BTH, or
                                                   code_BTR [+ residual] at a low-rank cut),
                                                   pad_mask_BT
    VAL_RETURN   worker -> owner  activation lane  the body's crossing

    .venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from splitlab.errors import PeerLostError, ProtocolError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.train.nodes import (
    Batch,
    Crossing,
    OwnerNode,
    WorkerNode,
    as_crossing,
    autocast,
    device_of,
    pick,
    widened,
)
from splitlab.train.protocol import IDLE_WAIT_S, owned_on, try_recv
from splitlab.train.protocol import PAD_MASK as WIRE_PAD_MASK
from splitlab.train.validate import Metrics, evaluate
from splitlab.wire.base import Transport
from splitlab.wire.frame import Lane, Routing

VAL_FORWARD = "val_forward"
VAL_RETURN = "val_return"


def validate_owner(
    node: OwnerNode, transport: Transport, worker: str, batches: Sequence[Batch], timeout_s: float
) -> Metrics:
    """Metrics of front -> `worker`'s body -> tail over `batches` (eval mode, no graphs)."""
    parts = (node.front, node.tail)
    modes = [part.training for part in parts]
    for part in parts:
        part.eval()
    counter = iter(range(1 << 30))

    def logits(batch: Batch) -> torch.Tensor:
        pad_mask = batch[PAD_MASK]
        positions = positions_from_pad_mask(pad_mask)
        index = next(counter)
        with torch.no_grad(), autocast(node.compute_dtype, device_of(node.front)):
            out = widened(as_crossing(node.front(batch[INPUT_IDS], pad_mask, positions)),
                          node.compute_dtype)  # fmt: skip
        tensors = {**out, WIRE_PAD_MASK: pad_mask}
        routing = Routing(microbatch=index)
        transport.send(
            worker, Lane.ACTIVATION, VAL_FORWARD, tensors, routing=routing, timeout_s=timeout_s
        ).wait(timeout_s)
        with transport.recv(Lane.ACTIVATION, timeout_s=timeout_s, peer_id=worker) as msg:
            if msg.kind != VAL_RETURN or msg.routing.microbatch != index:
                raise ProtocolError(
                    f"{msg.kind} #{msg.routing.microbatch} from {worker!r}, expected {VAL_RETURN} #{index}"
                )
            returned = owned_on(msg, transport, device_of(node.tail))
        with torch.no_grad(), autocast(node.compute_dtype, device_of(node.tail)):
            out = node.tail(part_input(node.tail, returned, worker), pad_mask, positions)
        return out.float()

    try:
        return evaluate(logits, node.tail.adapter, batches)
    finally:
        for part, mode in zip(parts, modes, strict=True):
            part.train(mode)


def serve_validation(node: WorkerNode, transport: Transport, wait_s: float = IDLE_WAIT_S) -> bool:
    """Answer one VAL_FORWARD if one arrives within `wait_s`; False when none did."""
    try:
        msg = try_recv(transport, Lane.ACTIVATION, wait_s)
    except PeerLostError:
        # Between rounds an owner that finished (STOP) closes its lanes; that is no error
        # here, and a peer lost for real surfaces at the next window or as a bus timeout.
        time.sleep(wait_s)
        return False
    if msg is None:
        return False
    with msg:
        if msg.kind != VAL_FORWARD:
            raise ProtocolError(f"{msg.kind} from {msg.peer!r} outside a window")
        received = owned_on(msg, transport, device_of(node.body))
        routing = msg.routing
    pad_mask = received.pop(WIRE_PAD_MASK)
    mode = node.body.training
    node.body.eval()
    try:
        with torch.no_grad(), autocast(node.compute_dtype, device_of(node.body)):
            x = part_input(node.body, received, msg.peer)
            out = as_crossing(node.body(x, pad_mask, positions_from_pad_mask(pad_mask)))
        out = widened(out, node.compute_dtype)
    finally:
        node.body.train(mode)
    transport.send(msg.peer, Lane.ACTIVATION, VAL_RETURN, out, routing=routing).wait()
    return True


def part_input(part: Part, crossing: Crossing, peer: str) -> torch.Tensor | Crossing:
    """What `part` takes from a received crossing: the named tensors at a low-rank cut, else
    the hidden state."""
    picked = pick(crossing, part.receives, f"validation input from {peer!r}")
    return part.input_of(picked)
