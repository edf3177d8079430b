"""What an owner and a worker compute for one microbatch, and the live graphs they keep.

These are the node-side halves of the U-shape step, written once and called both by the
in-process oracle (`splitlab.reference.ushape`, direct calls) and by the networked schedulers (on received frames):

    owner   front_forward(mb, batch)         -> crossing to send  (front graph kept)
    worker  body_forward(key, crossing, ..)  -> crossing to return (body graph kept)
    owner   tail_step(mb, crossing, scale)   -> grads to send     (tail fwd+loss+bwd at once)
    worker  body_backward(key, grads)        -> grads to return   (body graph released)
    owner   front_backward(mb, grads)                             (front graph released)

A crossing is a mapping of named tensors, `Part.sends` of the sender (= `Part.receives` of the
receiver): `{"hidden_BTH"}` at an ordinary cut, `{"code_BTR"}` or `{"code_BTR",
"residual_BTH"}` at a low-rank cut (`splitlab.models.lowrank`). Gradients travel under
`grad_name(name)`: `grad_BTH` for hidden_BTH, `grad_code_BTR`, `grad_residual_BTH`. A node takes
the names its part needs from a received mapping and ignores the rest (e.g. the padding mask
that shares the frame), so the schedulers ship whatever mapping the halves give.

Every forward runs once (dropout masks are drawn once, the backward reuses them); a graph is
dropped the moment its backward ran. Each tensor a node sends is checked for NaN/Inf first, so
the error names the node that produced it and the microbatch.

Legend: B batch, T tokens, H hidden size, R rank of a low-rank cut.

    .venv/bin/pytest tests/equivalence/test_train_engine.py -q
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from splitlab.errors import NonFiniteError, ProtocolError
from splitlab.models.families import INPUT_IDS, PAD_MASK
from splitlab.models.parts import HIDDEN, Part, group
from splitlab.models.tokens import positions_from_pad_mask

T = TypeVar("T")
Batch = Mapping[str, torch.Tensor]
Crossing = Mapping[str, torch.Tensor]  # named tensors at a cut (activations or gradients)
Live = dict[Hashable, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def grad_name(name: str) -> str:
    """The wire name of the gradient of crossing tensor `name` (`hidden_BTH` -> `grad_BTH`)."""
    return "grad_BTH" if name == HIDDEN else f"grad_{name}"


def as_crossing(out: torch.Tensor | Crossing) -> dict[str, torch.Tensor]:
    """A part's output as named tensors (an ordinary cut returns a bare hidden_BTH)."""
    return dict(out) if isinstance(out, Mapping) else {HIDDEN: out}


def pick(received: Crossing, names: Sequence[str], what: str) -> dict[str, torch.Tensor]:
    """The tensors `names` of a received mapping.

    Raises:
        ProtocolError: one is missing (naming it, what was received and `what` it is for).
    """
    missing = [name for name in names if name not in received]
    if missing:
        raise ProtocolError(f"{what} needs {missing} but got {sorted(received)}")
    return {name: received[name] for name in names}


def leaves(crossing: Crossing, device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh autograd leaves on `device` for a received crossing (the graph starts here)."""
    return {n: t.detach().to(device).requires_grad_() for n, t in crossing.items()}


def leaf_grads(inputs: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """The gradients at a part's input leaves, under their wire names, checked finite."""
    grads = {}
    for name, leaf in inputs.items():
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        check_finite_tensor(grad, f"{what} ({name})")
        grads[grad_name(name)] = grad
    return grads


def backward_crossing(outputs: Mapping[str, torch.Tensor], grads: Crossing, what: str) -> None:
    """Backward through a kept graph from the gradients of its crossing tensors."""
    wanted = pick(grads, [grad_name(n) for n in outputs], what)
    tensors = list(outputs.values())
    torch.autograd.backward(
        tensors, [g.to(t.device) for g, t in zip(wanted.values(), tensors, strict=True)]
    )


def autocast(dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a part computes in: `torch.autocast` in `dtype` (matmuls and attention in
    bf16; norms, softmax and losses stay fp32), or nothing for None (the weights' own dtype)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def widened(
    crossing: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """`crossing` with tensors that autocast left in `dtype` cast back to fp32 (in the graph):
    what crosses the wire keeps the weights' dtype whatever a node computes in."""
    if dtype is None:
        return dict(crossing)
    return {n: t.float() if t.dtype == dtype else t for n, t in crossing.items()}


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

    def time(self, device: torch.device, fn: Callable[[], T]) -> T:
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


def _take(live: Live, key: Hashable, node: str):
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
    compute_dtype: torch.dtype | None = None  # autocast dtype (finetune.compute_dtype)
    _live: Live = field(default_factory=dict)

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

    def front_forward(self, microbatch: Hashable, batch: Batch) -> dict[str, torch.Tensor]:
        """Embeddings + front blocks; returns detached copies of `front.sends` to send."""
        pad_mask = batch[PAD_MASK]
        with autocast(self.compute_dtype, device_of(self.front)):
            out = self.front(batch[INPUT_IDS], pad_mask, positions_from_pad_mask(pad_mask))
        front_out = widened(as_crossing(out), self.compute_dtype)
        for name, tensor in front_out.items():
            check_finite_tensor(
                tensor, f"front output of owner {self.name!r}, microbatch {microbatch} ({name})"
            )
        sent = {name: tensor.detach() for name, tensor in front_out.items()}
        self._live[microbatch] = (front_out, sent)
        self.num_samples += int(pad_mask.shape[0])
        return sent

    def tail_step(
        self, microbatch: Hashable, crossing: Crossing, batch: Batch, scale: float
    ) -> tuple[dict[str, torch.Tensor], float]:
        """Tail forward, loss x `scale`, backward at once; returns (grads to the body, loss)."""
        pad_mask = batch[PAD_MASK]
        what = f"tail of owner {self.name!r}, microbatch {microbatch}"
        tail_in = leaves(pick(crossing, self.tail.receives, what), device_of(self.tail))
        x = self.tail.input_of(tail_in)
        with autocast(self.compute_dtype, device_of(self.tail)):
            logits = self.tail(x, pad_mask, positions_from_pad_mask(pad_mask))
        adapter = self.tail.adapter
        loss = adapter.loss(logits.float(), adapter.labels(batch))
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteError(f"loss {value} on owner {self.name!r}, microbatch {microbatch}")
        (loss * scale).backward()
        grads = leaf_grads(tail_in, f"tail gradient of owner {self.name!r}, mb {microbatch}")
        return grads, value

    def front_backward(self, microbatch: Hashable, grads: Crossing) -> None:
        front_out, _ = _take(self._live, microbatch, self.name)
        backward_crossing(
            front_out, grads, f"front backward of owner {self.name!r}, microbatch {microbatch}"
        )


@dataclass
class WorkerNode:
    """A compute worker's body replica, its optimizer and its live body graphs."""

    name: str
    body: Part
    optimizer: torch.optim.Optimizer
    clock: Callable[[], float] = time.perf_counter  # body timing for adaptive weights
    num_samples: int = 0  # sequences processed this round (the FedAvg weight)
    padded_tokens: int = 0  # this window, for the throughput report
    compute_dtype: torch.dtype | None = None  # autocast dtype (finetune.compute_dtype)
    _live: Live = field(default_factory=dict)
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
        self, key: Hashable, crossing: Crossing, pad_mask_BT: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Run the body on received tensors (`body.receives`; owned by the caller: clone
        pooled views); returns detached copies of `body.sends`."""
        device = device_of(self.body)
        what = f"body of worker {self.name!r}, microbatch {key}"
        pad_mask_BT = pad_mask_BT.to(device)
        body_in = leaves(pick(crossing, self.body.receives, what), device)
        x = self.body.input_of(body_in)
        positions = positions_from_pad_mask(pad_mask_BT)

        def forward() -> torch.Tensor | Crossing:
            with autocast(self.compute_dtype, device):
                return self.body(x, pad_mask_BT, positions)

        body_out = widened(as_crossing(self.timer.time(device, forward)), self.compute_dtype)
        for name, tensor in body_out.items():
            check_finite_tensor(
                tensor, f"body output of worker {self.name!r}, microbatch {key} ({name})"
            )
        self._live[key] = (body_in, body_out)
        self.num_samples += int(pad_mask_BT.shape[0])
        self.padded_tokens += int(pad_mask_BT.numel())
        return {name: tensor.detach() for name, tensor in body_out.items()}

    def body_backward(self, key: Hashable, grads: Crossing) -> dict[str, torch.Tensor]:
        """Backward through the kept graph, release it, return the gradients at the front cut."""
        body_in, body_out = _take(self._live, key, self.name)
        what = f"body backward of worker {self.name!r}, microbatch {key}"

        def backward() -> None:
            backward_crossing(body_out, grads, what)

        self.timer.time(device_of(self.body), backward)
        return leaf_grads(body_in, f"body gradient of worker {self.name!r}, microbatch {key}")
