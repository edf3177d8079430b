"""Two-stage training over a tensor transport: first stage (owner) and last stage (worker).

The first stage forwards a window of up to `control_count` microbatches, keeping each output's
graph under its microbatch id and sending a copy with the padding mask and the *labels* (this
mode's privacy trade: labels travel). The last stage runs forward, loss, backward and an
optimizer step per microbatch in arrival order, and returns the gradient at the cut. The first
stage backpropagates each gradient as it arrives (any order), releases that graph, and after
the window's last one averages its gradients over the window's real count and steps once.

    STAGE_FORWARD   first -> last   activation lane  hidden_BTH, pad_mask_BT, labels
    STAGE_BACKWARD  last -> first   gradient lane    grad_BTH   (priority BACKWARD)

    .venv/bin/pytest tests/equivalence/test_train_two_stage.py -q
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from splitlab.errors import ConfigError, NonFiniteError, ProtocolError, WaitTimeoutError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.train.engine import Emit
from splitlab.train.nodes import Batch, check_finite_tensor, clip_and_step, partition_parameters
from splitlab.train.protocol import GRAD, HIDDEN, owned
from splitlab.train.protocol import PAD_MASK as WIRE_PAD_MASK
from splitlab.wire.base import Priority, Transport
from splitlab.wire.frame import Lane, Routing

STAGE_FORWARD = "stage_forward"
STAGE_BACKWARD = "stage_backward"
LABELS = "labels"


class FirstStage:
    """The data owner's stage: embeddings + first blocks, one step per window."""

    def __init__(
        self,
        *,
        part: Part,
        optimizer: torch.optim.Optimizer,
        transport: Transport,
        last_stage: str,
        control_count: int,
        clip_grad_norm: float = 0.0,
        timeout_s: float = 120.0,
        emit: Emit | None = None,
    ) -> None:
        if control_count < 1:
            raise ConfigError(f"architecture.control_count={control_count}: must be >= 1")
        self.part, self.optimizer, self.transport = part, optimizer, transport
        self.last_stage, self.control_count = last_stage, control_count
        self.clip_grad_norm, self.timeout_s = clip_grad_norm, timeout_s
        self.params = partition_parameters(part)
        self.emit: Emit = emit or (lambda kind, **fields: None)

    def run(self, batches: Sequence[Batch]) -> None:
        for window_id, start in enumerate(range(0, len(batches), self.control_count)):
            self._window(window_id, start, batches[start : start + self.control_count])

    def _window(self, window_id: int, first_id: int, chunk: Sequence[Batch]) -> None:
        live: dict[int, torch.Tensor] = {}
        adapter = self.part.adapter
        for offset, batch in enumerate(chunk):
            data_id = first_id + offset
            pad_mask = batch[PAD_MASK]
            output = self.part(batch[INPUT_IDS], pad_mask, positions_from_pad_mask(pad_mask))
            check_finite_tensor(output, f"first-stage output of microbatch {data_id}")
            live[data_id] = output  # the graph stays here; a detached copy travels
            tensors = {
                HIDDEN: output.detach(),
                WIRE_PAD_MASK: pad_mask,
                LABELS: adapter.labels(batch),
            }
            self.transport.send(
                self.last_stage, Lane.ACTIVATION, STAGE_FORWARD, tensors,
                routing=Routing(window=window_id, microbatch=data_id), timeout_s=self.timeout_s,
            ).wait(self.timeout_s)  # fmt: skip
            self.emit("forward", window=window_id, microbatch=data_id, stage="first")
        while live:
            msg = self.transport.recv(
                Lane.GRADIENT, timeout_s=self.timeout_s, peer_id=self.last_stage
            )
            with msg:
                data_id = msg.routing.microbatch
                if msg.kind != STAGE_BACKWARD or data_id not in live:
                    raise ProtocolError(
                        f"{msg.kind} for microbatch {data_id} from {msg.peer!r}; live: {sorted(live)}"
                    )
                grad = owned(msg, GRAD)
            live.pop(data_id).backward(grad)  # releases this graph
            self.emit("backward", window=window_id, microbatch=data_id, stage="first")
        for param in self.params:
            if param.grad is not None:
                param.grad.div_(len(chunk))
        clip_and_step(self.params, self.optimizer, self.clip_grad_norm)
        self.emit("step", window=window_id, stage="first", num_microbatches=len(chunk))


class LastStage:
    """The remaining blocks + head + loss; steps after every microbatch."""

    def __init__(
        self,
        *,
        part: Part,
        optimizer: torch.optim.Optimizer,
        transport: Transport,
        clip_grad_norm: float = 0.0,
        timeout_s: float = 120.0,
        emit: Emit | None = None,
    ) -> None:
        self.part, self.optimizer, self.transport = part, optimizer, transport
        self.clip_grad_norm, self.timeout_s = clip_grad_norm, timeout_s
        self.params = partition_parameters(part)
        self.emit: Emit = emit or (lambda kind, **fields: None)

    def serve(self, expected_by_owner: Mapping[str, int]) -> list[float]:
        """Process every owner's microbatches as they arrive; returns the losses in that order."""
        remaining = dict(expected_by_owner)
        losses: list[float] = []
        while any(remaining.values()):
            try:
                msg = self.transport.recv(Lane.ACTIVATION, timeout_s=self.timeout_s)
            except WaitTimeoutError:
                waiting = sorted(o for o, n in remaining.items() if n)
                raise WaitTimeoutError(
                    f"last stage {self.transport.peer_id!r} waited {self.timeout_s:.1f} s for "
                    f"microbatches from {waiting}"
                ) from None
            with msg:
                if msg.kind != STAGE_FORWARD or remaining.get(msg.peer, 0) < 1:
                    raise ProtocolError(f"unexpected {msg.kind} from {msg.peer!r}")
                hidden, pad_mask, labels = (
                    owned(msg, HIDDEN),
                    owned(msg, WIRE_PAD_MASK),
                    owned(msg, LABELS),
                )
                routing = msg.routing
            remaining[msg.peer] -= 1
            leaf = hidden.requires_grad_()
            logits = self.part(leaf, pad_mask, positions_from_pad_mask(pad_mask))
            loss = self.part.adapter.loss(logits, labels)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteError(
                    f"last-stage loss {value} on microbatch {routing.microbatch} from {msg.peer!r}"
                )
            loss.backward()
            clip_and_step(self.params, self.optimizer, self.clip_grad_norm)
            assert leaf.grad is not None
            check_finite_tensor(
                leaf.grad, f"last-stage gradient of microbatch {routing.microbatch}"
            )
            self.transport.send(
                msg.peer, Lane.GRADIENT, STAGE_BACKWARD, {GRAD: leaf.grad},
                routing=routing, priority=Priority.BACKWARD, timeout_s=self.timeout_s,
            ).wait(self.timeout_s)  # fmt: skip
            losses.append(value)
            self.emit("step", microbatch=routing.microbatch, stage="last", owner=msg.peer)
        return losses
