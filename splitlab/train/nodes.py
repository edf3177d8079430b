"""What an owner and a worker compute for one microbatch, and the live graphs they keep.

These are the node-side halves of the U-shape step, written once and called both by the
in-process engine (direct calls) and by the networked schedulers (on received frames):

    owner   front_forward(mb, batch)          -> hidden_BTH to send   (front graph kept)
    worker  body_forward(key, hidden_BTH, ..) -> hidden_BTH to return (body graph kept)
    owner   tail_step(mb, hidden_BTH, scale)  -> grad_BTH to send     (tail fwd+loss+bwd at once)
    worker  body_backward(key, grad_BTH)      -> grad_BTH to return   (body graph released)
    owner   front_backward(mb, grad_BTH)                              (front graph released)

Every forward runs once (dropout masks are drawn once, the backward reuses them); a graph is
dropped the moment its backward ran. Each tensor a node sends is checked for NaN/Inf first, so
the error names the node that produced it and the microbatch.

Legend: B batch, T tokens, H hidden size.

    .venv/bin/pytest tests/equivalence/test_train_engine.py -q
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from splitlab.errors import NonFiniteError, ProtocolError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import Part, group
from splitlab.models.tokens import positions_from_pad_mask

Batch = Mapping[str, torch.Tensor]


def partition_parameters(*modules: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters of `modules`, each tensor once (a tied head appears once)."""
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def check_finite_tensor(tensor: torch.Tensor, what: str) -> None:
    """Raises: NonFiniteError with `what` (which tensor, from which node, which microbatch)."""
    if not bool(torch.isfinite(tensor).all()):
        raise NonFiniteError(f"non-finite values in {what}")


def clip_and_step(
    params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer, clip: float
) -> None:
    """Clip this partition's gradients on their own (if `clip` > 0), step, zero."""
    if clip > 0.0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def device_of(module: nn.Module) -> torch.device:
    """Where a part computes (its first parameter or buffer; CPU for an empty part)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


class BodyTimer:
    """Body compute seconds: CUDA events on a GPU (read once, at the window boundary, so the
    compute stream is never synchronised mid-window), the injected clock on a CPU."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def time(self, device: torch.device, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self._events.append((start, end))
            return out
        began = self.clock()
        out = fn()
        self.seconds += self.clock() - began
        return out

    def total_s(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
            self._events.clear()
        return self.seconds


def _take(live: dict[Hashable, tuple[torch.Tensor, torch.Tensor]], key: Hashable, node: str):
    try:
        return live.pop(key)
    except KeyError:
        raise ProtocolError(f"{node!r} has no live graph for microbatch {key!r}") from None


@dataclass
class OwnerNode:
    """A data owner's partition (front + tail, one optimizer, tied tensors once)."""

    name: str
    front: Part
    tail: Part
    optimizer: torch.optim.Optimizer
    num_samples: int = 0  # sequences processed this round (the FedAvg weight)
    _live: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def params(self) -> list[nn.Parameter]:
        return partition_parameters(self.front, self.tail)

    @property
    def live(self) -> int:
        """Microbatches whose front graph waits for its backward."""
        return len(self._live)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The owner partition under the original checkpoint keys."""
        return group([self.front, self.tail]).state_dict()

    def front_forward(self, microbatch: Hashable, batch: Batch) -> torch.Tensor:
        pad_mask = batch[PAD_MASK]
        front_out = self.front(batch[INPUT_IDS], pad_mask, positions_from_pad_mask(pad_mask))
        check_finite_tensor(
            front_out, f"front output of owner {self.name!r}, microbatch {microbatch}"
        )
        sent = front_out.detach()
        self._live[microbatch] = (front_out, sent)
        self.num_samples += int(pad_mask.shape[0])
        return sent

    def tail_step(
        self, microbatch: Hashable, hidden_BTH: torch.Tensor, batch: Batch, scale: float
    ) -> tuple[torch.Tensor, float]:
        """Tail forward, loss x `scale`, backward at once; returns (grad to the body, loss)."""
        pad_mask = batch[PAD_MASK]
        tail_in = hidden_BTH.detach().to(device_of(self.tail)).requires_grad_()
        logits = self.tail(tail_in, pad_mask, positions_from_pad_mask(pad_mask))
        adapter = self.tail.adapter
        loss = adapter.loss(logits, adapter.labels(batch))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(f"loss {value} on owner {self.name!r}, microbatch {microbatch}")
        (loss * scale).backward()
        assert tail_in.grad is not None
        check_finite_tensor(
            tail_in.grad, f"tail gradient of owner {self.name!r}, microbatch {microbatch}"
        )
        return tail_in.grad, value

    def front_backward(self, microbatch: Hashable, grad_BTH: torch.Tensor) -> None:
        front_out, _ = _take(self._live, microbatch, self.name)
        front_out.backward(grad_BTH.to(front_out.device))


@dataclass
class WorkerNode:
    """A compute worker's body replica, its optimizer and its live body graphs."""

    name: str
    body: Part
    optimizer: torch.optim.Optimizer
    clock: Callable[[], float] = time.perf_counter  # body timing for adaptive weights
    num_samples: int = 0  # sequences processed this round (the FedAvg weight)
    padded_tokens: int = 0  # this window, for the throughput report
    _live: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _timer: BodyTimer | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return partition_parameters(self.body)

    @property
    def live(self) -> int:
        return len(self._live)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.body.state_dict()

    def start_window(self) -> None:
        self.padded_tokens, self._timer = 0, BodyTimer(self.clock)

    @property
    def compute_s(self) -> float:
        """This window's body forward + backward seconds (waits for CUDA events if any)."""
        return self._timer.total_s() if self._timer is not None else 0.0

    def tokens_per_s(self) -> float | None:
        seconds = self.compute_s
        return self.padded_tokens / seconds if seconds > 0 else None

    @property
    def timer(self) -> BodyTimer:
        if self._timer is None:
            self._timer = BodyTimer(self.clock)
        return self._timer

    def body_forward(
        self, key: Hashable, hidden_BTH: torch.Tensor, pad_mask_BT: torch.Tensor
    ) -> torch.Tensor:
        """Run the body on a received hidden state (owned by the caller: clone pooled views)."""
        device = device_of(self.body)
        pad_mask_BT = pad_mask_BT.to(device)
        body_in = hidden_BTH.detach().to(device).requires_grad_()
        positions = positions_from_pad_mask(pad_mask_BT)
        body_out = self.timer.time(device, lambda: self.body(body_in, pad_mask_BT, positions))
        check_finite_tensor(body_out, f"body output of worker {self.name!r}, microbatch {key}")
        self._live[key] = (body_in, body_out)
        self.num_samples += int(pad_mask_BT.shape[0])
        self.padded_tokens += int(pad_mask_BT.numel())
        return body_out.detach()

    def body_backward(self, key: Hashable, grad_BTH: torch.Tensor) -> torch.Tensor:
        """Backward through the kept graph, release it, return the gradient at the front cut."""
        body_in, body_out = _take(self._live, key, self.name)
        grad_BTH = grad_BTH.to(body_out.device)

        def backward() -> torch.Tensor:
            body_out.backward(grad_BTH)
            return body_out

        self.timer.time(body_out.device, backward)
        assert body_in.grad is not None
        check_finite_tensor(
            body_in.grad, f"body gradient of worker {self.name!r}, microbatch {key}"
        )
        return body_in.grad
