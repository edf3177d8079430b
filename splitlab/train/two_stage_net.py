"""Two-stage training over a tensor transport: first stage (owner) and last stage (worker).

The first stage forwards a window of up to `control_count` microbatches, keeping each output's
graph under its microbatch id and sending a copy with the padding mask and the *labels* (this
mode's privacy trade: labels travel). The last stage runs forward, loss, backward and an
optimizer step per microbatch in arrival order, and returns the gradient at the cut with the
loss (the labels already crossed, so the loss reveals nothing new). The first stage
backpropagates each gradient as it arrives (any order), releases that graph, and after the
window's last one averages its gradients over the window's real count and steps once.

    STAGE_FORWARD   first -> last   activation lane  the crossing (hidden_BTH, or code_BTR
                                                     [+ residual] at a low-rank cut),
                                                     pad_mask_BT, labels
    STAGE_BACKWARD  last -> first   gradient lane    grad_<crossing>, loss   (priority BACKWARD)
    STAGE_END       first -> last   activation lane  count: the round's microbatches (processes
                                                     that do not know an owner's count wait
                                                     for this instead)
    STAGE_VAL       first -> last   activation lane  as STAGE_FORWARD, forward only (eval, no
                                                     graph), before STAGE_END
    STAGE_VAL_RETURN last -> first  activation lane  loss, correct (classification): the owner
                                                     aggregates them (`validate`)

    .venv/bin/pytest tests/equivalence/test_train_two_stage.py -q
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from splitlab.config.enums import TaskKind
from splitlab.errors import ConfigError, NonFiniteError, ProtocolError, WaitTimeoutError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.telemetry.records import BackwardRecord, Emit, ForwardRecord, Record, StepRecord
from splitlab.train.nodes import (
    Batch,
    as_crossing,
    backward_crossing,
    check_finite_tensor,
    clip_and_step,
    device_of,
    leaf_grads,
    leaves,
    partition_parameters,
    pick,
)
from splitlab.train.objective import num_targets
from splitlab.train.protocol import PAD_MASK as WIRE_PAD_MASK
from splitlab.train.protocol import owned
from splitlab.train.validate import Metrics
from splitlab.wire.base import Message, Priority, Transport
from splitlab.wire.frame import Lane, Routing

STAGE_FORWARD = "stage_forward"
STAGE_BACKWARD = "stage_backward"
STAGE_END = "stage_end"
STAGE_VAL = "stage_val"
STAGE_VAL_RETURN = "stage_val_return"
CORRECT = "correct"
LABELS = "labels"
LOSS = "loss"
COUNT = "count"


def _emit_nothing(record: Record) -> None:
    return None


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
        self.emit: Emit = emit or _emit_nothing
        self.peak_live = 0  # most first-stage graphs held at once since the last reset

    def run(self, batches: Sequence[Batch], *, first_window: int = 0) -> list[float]:
        """Train on `batches` in windows of `control_count` (window ids from `first_window`);
        returns the last stage's losses, in the order the gradients came back."""
        losses: list[float] = []
        for offset, start in enumerate(range(0, len(batches), self.control_count)):
            chunk = batches[start : start + self.control_count]
            losses += self._window(first_window + offset, start, chunk)
        return losses

    def end_round(self, count: int) -> None:
        """Tell the last stage this round sent `count` microbatches (see `LastStage.serve`)."""
        self.transport.send(
            self.last_stage, Lane.ACTIVATION, STAGE_END, {COUNT: torch.tensor([count])},
            timeout_s=self.timeout_s,
        ).wait(self.timeout_s)  # fmt: skip

    def validate(self, batches: Sequence[Batch]) -> Metrics:
        """Held-out metrics through the last stage (eval mode, no graphs), as `evaluate`'s."""
        mode, adapter = self.part.training, self.part.adapter
        self.part.eval()
        losses: list[float] = []
        samples = correct = targets = 0
        token_loss = 0.0
        try:
            for index, batch in enumerate(batches):
                with torch.no_grad():
                    tensors = self._crossing(batch, f"validation batch {index}")
                self.transport.send(
                    self.last_stage, Lane.ACTIVATION, STAGE_VAL, tensors,
                    routing=Routing(microbatch=index), timeout_s=self.timeout_s,
                ).wait(self.timeout_s)  # fmt: skip
                with self.transport.recv(
                    Lane.ACTIVATION, timeout_s=self.timeout_s, peer_id=self.last_stage
                ) as msg:
                    if msg.kind != STAGE_VAL_RETURN or msg.routing.microbatch != index:
                        raise ProtocolError(
                            f"{msg.kind} from {msg.peer!r}, expected {STAGE_VAL_RETURN}"
                        )
                    loss, right = float(msg.tensors[LOSS]), int(msg.tensors[CORRECT])
                losses.append(loss)
                samples += int(batch[PAD_MASK].shape[0])
                correct += right
                count = num_targets(adapter, batch)
                targets, token_loss = targets + count, token_loss + loss * count
        finally:
            self.part.train(mode)
        mean = sum(losses) / len(losses) if losses else math.nan
        if adapter.task is TaskKind.classification:
            return Metrics(mean, samples, accuracy=correct / samples if samples else None)
        return Metrics(
            mean, samples, perplexity=math.exp(token_loss / targets) if targets else None
        )

    def _crossing(self, batch: Batch, what: str) -> dict[str, torch.Tensor]:
        """The first stage's output on `batch`, with the padding mask and the labels."""
        pad_mask = batch[PAD_MASK]
        output = as_crossing(
            self.part(batch[INPUT_IDS], pad_mask, positions_from_pad_mask(pad_mask))
        )
        for name, tensor in output.items():
            check_finite_tensor(tensor, f"first-stage output of {what} ({name})")
        return {**output, WIRE_PAD_MASK: pad_mask, LABELS: self.part.adapter.labels(batch)}

    def _window(self, window_id: int, first_id: int, chunk: Sequence[Batch]) -> list[float]:
        live: dict[int, dict[str, torch.Tensor]] = {}
        for offset, batch in enumerate(chunk):
            data_id = first_id + offset
            output = self._crossing(batch, f"microbatch {data_id}")
            tensors = {n: t.detach() for n, t in output.items()}
            for name in (WIRE_PAD_MASK, LABELS):
                output.pop(name)
            live[data_id] = output  # the graph stays here; detached copies travel
            self.peak_live = max(self.peak_live, len(live))
            self.transport.send(
                self.last_stage, Lane.ACTIVATION, STAGE_FORWARD, tensors,
                routing=Routing(window=window_id, microbatch=data_id), timeout_s=self.timeout_s,
            ).wait(self.timeout_s)  # fmt: skip
            self.emit(ForwardRecord(window=window_id, microbatch=data_id, part="first"))
        losses: list[float] = []
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
                grads = {n: owned(msg, n) for n in msg.tensors if n != LOSS}
                if LOSS in msg.tensors:
                    losses.append(float(msg.tensors[LOSS]))
            backward_crossing(  # releases this graph
                live.pop(data_id), grads, f"first-stage backward of microbatch {data_id}"
            )
            self.emit(BackwardRecord(window=window_id, microbatch=data_id, part="first"))
        for param in self.params:
            if param.grad is not None:
                param.grad.div_(len(chunk))
        clip_and_step(self.params, self.optimizer, self.clip_grad_norm)
        self.emit(StepRecord(window=window_id, part="first", num_microbatches=len(chunk)))
        return losses


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
        self.device = device_of(part)
        self.emit: Emit = emit or _emit_nothing
        self.num_samples = 0  # sequences trained on since the last reset

    def serve(self, expected_by_owner: Mapping[str, int | None]) -> dict[str, list[float]]:
        """Process every owner's microbatches as they arrive: `n` from an owner, or, for None,
        until its STAGE_END. Returns each owner's losses in arrival order."""
        remaining = {o: (math.inf if n is None else n) for o, n in expected_by_owner.items()}
        losses: dict[str, list[float]] = {o: [] for o in expected_by_owner}
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
                peer, routing = msg.peer, msg.routing
                if msg.kind == STAGE_END and remaining.get(peer) == math.inf:
                    remaining[peer] = 0
                    continue
                if msg.kind == STAGE_VAL and peer in remaining:
                    self._answer_validation(msg)
                    continue
                if msg.kind != STAGE_FORWARD or remaining.get(peer, 0) < 1:
                    raise ProtocolError(f"unexpected {msg.kind} from {peer!r}")
                received = {n: owned(msg, n) for n in msg.tensors}
            remaining[peer] -= 1
            grads, value = self._step(received, routing.microbatch, peer)
            grads[LOSS] = torch.tensor([value])
            self.transport.send(
                peer, Lane.GRADIENT, STAGE_BACKWARD, grads,
                routing=routing, priority=Priority.BACKWARD, timeout_s=self.timeout_s,
            ).wait(self.timeout_s)  # fmt: skip
            losses[peer].append(value)
            self.emit(StepRecord(microbatch=routing.microbatch, part="last", owner=peer))
        return losses

    def _answer_validation(self, msg: Message) -> None:
        received = {n: owned(msg, n) for n in msg.tensors}
        what = f"validation batch {msg.routing.microbatch} from {msg.peer!r}"
        inputs = pick(received, self.part.receives, what)
        x = self.part.input_of(inputs)
        pad_mask, labels = received[WIRE_PAD_MASK], received[LABELS]
        mode, adapter = self.part.training, self.part.adapter
        self.part.eval()
        try:
            with torch.no_grad():
                logits = self.part(x, pad_mask, positions_from_pad_mask(pad_mask))
                loss = adapter.loss(logits, labels)
        finally:
            self.part.train(mode)
        correct = 0
        if adapter.task is TaskKind.classification:
            correct = int((logits.argmax(dim=-1) == labels.reshape(-1)).sum())
        answer = {LOSS: loss.detach().reshape(1), CORRECT: torch.tensor([correct])}
        self.transport.send(
            msg.peer, Lane.ACTIVATION, STAGE_VAL_RETURN, answer, routing=msg.routing,
            timeout_s=self.timeout_s,
        ).wait(self.timeout_s)  # fmt: skip

    def _step(
        self, received: Mapping[str, torch.Tensor], data_id: int, peer: str
    ) -> tuple[dict[str, torch.Tensor], float]:
        what = f"last stage, microbatch {data_id} from {peer!r}"
        inputs = leaves(pick(received, self.part.receives, what), self.device)
        x = self.part.input_of(inputs)
        pad_mask = received[WIRE_PAD_MASK].to(self.device)
        labels = received[LABELS].to(self.device)
        logits = self.part(x, pad_mask, positions_from_pad_mask(pad_mask))
        loss = self.part.adapter.loss(logits, labels)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(f"last-stage loss {value} on microbatch {data_id} from {peer!r}")
        loss.backward()
        clip_and_step(self.params, self.optimizer, self.clip_grad_norm)
        self.num_samples += int(pad_mask.shape[0])
        return leaf_grads(inputs, f"last-stage gradient of microbatch {data_id}"), value


def check_untied(first: torch.nn.Module, last: torch.nn.Module) -> None:
    """Refuse stages that share a parameter: a tied embedding and head split across two
    machines would be two copies that drift apart.

    Raises:
        ConfigError: naming the fix.
    """
    if {id(p) for p in first.parameters()} & {id(p) for p in last.parameters()}:
        raise ConfigError(
            "two-stage stages share a parameter (tied embedding and head): set "
            "model.untie_embeddings=true so the head becomes its own copy at load"
        )
