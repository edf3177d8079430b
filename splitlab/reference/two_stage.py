"""Two-stage training (the legacy mode), both stages in one process: the oracle the two-stage
nodes (`splitlab.train.two_stage_net`) match.

The first stage (embeddings + the first `cut_layers` blocks) holds the data; the last stage
(the remaining blocks + head) receives the hidden states *and the labels*, computes the loss,
steps after every microbatch and returns the gradient at the cut.

The first stage keeps up to `control_count` live graphs: it forwards a window of microbatches,
keeps each output with its autograd graph under the microbatch id (only a detached copy is
sent), and runs `output.backward(grad)` as each gradient comes back, in whatever order they
arrive; no second forward, so dropout masks are drawn once. Each graph is released right after
its backward. Once the window's gradients are all back, the accumulated parameter gradients
are averaged over the window's real count (a partial final window uses its own count) and the
first stage steps once. Its parameters therefore never change while one of its graphs is live.

    .venv/bin/pytest tests/equivalence/test_train_two_stage.py -q
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from splitlab.errors import ConfigError, NonFiniteError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.telemetry.records import BackwardRecord, Emit, ForwardRecord, StepRecord
from splitlab.train.nodes import (
    Batch,
    Crossing,
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
from splitlab.train.two_stage_net import check_untied

ReturnOrder = Callable[[int], Sequence[int]]  # window size -> order the gradients come back in


def in_order(count: int) -> list[int]:
    return list(range(count))


def reversed_order(count: int) -> list[int]:
    return list(reversed(range(count)))


class TwoStageEngine:
    """First stage + last stage with their own AdamW, the first stepping once per window.

    Raises:
        ConfigError: `control_count` < 1, or the stages share a parameter (a tied embedding
            and head would be two diverging copies across machines; untie it first).
    """

    def __init__(
        self,
        *,
        first: Part,
        last: Part,
        first_optimizer: torch.optim.Optimizer,
        last_optimizer: torch.optim.Optimizer,
        control_count: int,
        clip_grad_norm: float = 0.0,
        return_order: ReturnOrder = in_order,
        emit: Emit | None = None,
    ) -> None:
        if control_count < 1:
            raise ConfigError(f"architecture.control_count={control_count}: must be >= 1")
        check_untied(first, last)
        self.first, self.last = first, last
        self.first_optimizer, self.last_optimizer = first_optimizer, last_optimizer
        self.control_count = control_count
        self.clip_grad_norm = clip_grad_norm
        self.return_order = return_order
        self.emit: Emit = emit or (lambda record: None)
        self.first_params = partition_parameters(first)
        self.last_params = partition_parameters(last)
        self.last_device = device_of(last)

    def run(self, batches: Sequence[Batch]) -> list[float]:
        """Train on `batches` in windows of `control_count`; returns the per-microbatch losses."""
        losses: list[float] = []
        for window_id, start in enumerate(range(0, len(batches), self.control_count)):
            chunk = batches[start : start + self.control_count]
            losses += self._window(window_id, start, chunk)
        return losses

    def _window(self, window_id: int, first_id: int, chunk: Sequence[Batch]) -> list[float]:
        live: dict[int, dict[str, torch.Tensor]] = {}
        sent: list[tuple[int, dict[str, torch.Tensor], Batch]] = []
        for offset, batch in enumerate(chunk):
            data_id = first_id + offset
            pad_mask = batch[PAD_MASK]
            output = as_crossing(
                self.first(batch[INPUT_IDS], pad_mask, positions_from_pad_mask(pad_mask))
            )
            for name, tensor in output.items():
                check_finite_tensor(tensor, f"first-stage output of microbatch {data_id} ({name})")
            live[data_id] = output  # the graph stays here; only the copies below travel
            sent.append((data_id, {n: t.detach() for n, t in output.items()}, batch))
            self.emit(ForwardRecord(window=window_id, microbatch=data_id, part="first"))
        returned: dict[int, dict[str, torch.Tensor]] = {}
        losses: list[float] = []
        for data_id, hidden, batch in sent:
            grad, loss = self._last_stage_step(data_id, hidden, batch)
            returned[data_id] = grad
            losses.append(loss)
        order = [first_id + i for i in self.return_order(len(chunk))]
        if sorted(order) != sorted(live):
            raise ValueError(f"return order {order} is not a permutation of {sorted(live)}")
        for data_id in order:
            backward_crossing(  # releases this graph
                live.pop(data_id), returned.pop(data_id), f"first-stage backward of {data_id}"
            )
            self.emit(BackwardRecord(window=window_id, microbatch=data_id, part="first"))
        for param in self.first_params:
            if param.grad is not None:
                param.grad.div_(len(chunk))
        clip_and_step(self.first_params, self.first_optimizer, self.clip_grad_norm)
        self.emit(StepRecord(window=window_id, part="first", num_microbatches=len(chunk)))
        return losses

    def _last_stage_step(
        self, data_id: int, crossing: Crossing, batch: Batch
    ) -> tuple[dict[str, torch.Tensor], float]:
        """What the last stage does per arriving microbatch: forward, loss, backward, step."""
        what = f"last stage, microbatch {data_id}"
        inputs = leaves(pick(crossing, self.last.receives, what), self.last_device)
        x = self.last.input_of(inputs)
        pad_mask = batch[PAD_MASK]
        logits = self.last(x, pad_mask, positions_from_pad_mask(pad_mask))
        adapter = self.last.adapter
        loss = adapter.loss(logits, adapter.labels(batch))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(f"last-stage loss {value} on microbatch {data_id}")
        loss.backward()
        clip_and_step(self.last_params, self.last_optimizer, self.clip_grad_norm)
        return leaf_grads(inputs, f"last-stage gradient of microbatch {data_id}"), value
