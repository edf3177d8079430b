"""The cloud side of the two-line API: serve one edge's body part until it says bye.

`serve(model, key=...)` listens on a `TcpTransport`, takes the edge's `SplitSpec` and SVD
factors from sft.hello, cuts its own copy of the model the same way, and then answers
forward and backward frames in order (see `splitlab.sft.protocol`), keeping each
microbatch's graph until its backward arrives and running the edge's queued optimizer calls
before it next uses its parameters.

    .venv/bin/pytest tests/integration/test_sft_two_lines.py -q
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from splitlab.errors import ConfigError, PeerLostError, ProtocolError, WaitTimeoutError
from splitlab.models.families import family_for_model
from splitlab.models.lowrank import decompose_plan
from splitlab.models.parts import Part, build_parts
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.sft import protocol as p
from splitlab.train.optim import adamw
from splitlab.wire import Lane, Message, Priority, TcpTransport

log = logging.getLogger(__name__)

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
MAX_LIVE_GRAPHS = 64  # forwards awaiting their backward; more means the edge never calls it


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return adamw(params)


class _Inbox:
    """Both lanes' frames from the edge in one queue (the edge waits for every answer, so
    arrival order is the protocol's order)."""

    def __init__(self, transport: TcpTransport) -> None:
        self.frames: queue.Queue[Message | BaseException] = queue.Queue()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._pump, args=(transport, lane), daemon=True)
            for lane in Lane
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, transport: TcpTransport, lane: Lane) -> None:
        while not self._stop.is_set():
            try:
                self.frames.put(transport.recv(lane, timeout_s=0.2, peer_id=None))
            except WaitTimeoutError:
                continue
            except BaseException as exc:  # noqa: BLE001 - handed to the serving thread
                if not self._stop.is_set():
                    self.frames.put(exc)
                return

    def next(self, timeout_s: float) -> Message:
        try:
            item = self.frames.get(timeout=timeout_s)
        except queue.Empty:
            raise WaitTimeoutError(f"no frame from the edge within timeout_s={timeout_s}") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop reading (and wait for the readers, so a peer closing after this goes unseen)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=1.0)


class _Session:
    """One edge's body part, its optimizer and its live graphs."""

    def __init__(self, model: nn.Module, hello: Message, make_optimizer: MakeOptimizer) -> None:
        spec = p.SplitSpec.from_dict(hello.meta)
        adapter = family_for_model(model)
        num_layers = adapter.num_layers(model.config)
        if (spec.family, spec.num_layers) != (adapter.name, num_layers):
            raise ConfigError(
                f"the edge splits a {spec.family} model with {spec.num_layers} blocks; this "
                f"cloud holds a {adapter.name} model with {num_layers}"
            )
        plan = spec.plan()
        decompose_plan(model, plan, adapter=adapter)
        state = model.state_dict()
        missing = sorted(k for k in state if ".lowrank_" in k and k not in hello.tensors)
        if missing:
            raise ProtocolError(f"sft.hello lacks the SVD factors {missing}")
        with torch.no_grad():
            for key, value in hello.tensors.items():
                state[key].copy_(value)
        self.body: Part = build_parts(model, plan, adapter=adapter)[1]
        self.sends = p.LOGITS if plan.body.has_head else None  # name of a single output
        params = [q for q in self.body.parameters() if q.requires_grad]
        self.optimizer = make_optimizer(params)
        self.live: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    def run_ops(self, ops: list[dict[str, Any]]) -> None:
        for op in ops:
            if op.get("op") == "step":
                lrs = op.get("lr") or []
                for index, group in enumerate(self.optimizer.param_groups):
                    if lrs:
                        group["lr"] = lrs[min(index, len(lrs) - 1)]
                self.optimizer.step()
            elif op.get("op") == "zero_grad":
                self.optimizer.zero_grad(set_to_none=bool(op.get("set_to_none", True)))
            else:
                raise ProtocolError(f"unknown optimizer op {op!r}")

    def forward(self, msg: Message) -> dict[str, torch.Tensor]:
        self.run_ops(msg.meta.get("ops", []))
        grad = bool(msg.meta.get("grad"))
        self.body.train(bool(msg.meta.get("training", True)))
        pad_mask = msg.tensors[p.PAD_MASK].to(torch.long)
        inputs = {
            name: t.clone().requires_grad_(grad)
            for name, t in msg.tensors.items()
            if name != p.PAD_MASK
        }
        x = inputs if self.body.span.code_in is not None else next(iter(inputs.values()))
        with torch.set_grad_enabled(grad):
            out = self.body(x, pad_mask, positions_from_pad_mask(pad_mask))
        outputs = out if isinstance(out, dict) else {self.sends or "hidden_BTH": out}
        if grad:
            if len(self.live) >= MAX_LIVE_GRAPHS:
                raise ProtocolError(f"{len(self.live)} forwards without a backward")
            self.live[msg.routing.microbatch] = (inputs, outputs)
        return {name: t.detach() for name, t in outputs.items()}

    def backward(self, msg: Message) -> dict[str, torch.Tensor]:
        try:
            inputs, outputs = self.live.pop(msg.routing.microbatch)
        except KeyError:
            raise ProtocolError(
                f"backward for unknown microbatch {msg.routing.microbatch}"
            ) from None
        names = list(outputs)
        torch.autograd.backward([outputs[n] for n in names], [msg.tensors[n] for n in names])
        return {
            name: t.grad if t.grad is not None else torch.zeros_like(t)
            for name, t in inputs.items()
        }


def serve(
    model: nn.Module,
    *,
    key: bytes | str,
    host: str = "127.0.0.1",
    port: int = 0,
    session: str = "sft",
    make_optimizer: MakeOptimizer = _default_optimizer,
    timeout_s: float = 120.0,
    on_ready: Callable[[tuple[str, int]], None] | None = None,
) -> dict[str, Any]:
    """Serve one edge's session on the cloud, then return the transport's counters.

    Args:
        model: the same pre-trained model the edge loaded (unmodified; cut here per the edge).
        key: the per-session secret both sides share (never sent).
        make_optimizer: builds the cloud's optimizer over the body's trainable parameters
            (its learning rate follows the edge's at every step).
        on_ready: called with the (host, port) the edge should connect to.

    Raises:
        PeerLostError / WaitTimeoutError: the edge vanished or went quiet for timeout_s.
    """
    transport = TcpTransport(p.CLOUD, key=key, session=session, bind_host=host, port=port)
    inbox = _Inbox(transport)
    try:
        if on_ready is not None:
            on_ready(transport.address)
        with inbox.next(timeout_s) as hello:
            if hello.kind != p.HELLO:
                raise ProtocolError(f"expected {p.HELLO}, got {hello.kind!r}")
            try:
                state = _Session(model, hello, make_optimizer)
            except (ConfigError, ProtocolError) as exc:
                _reply(transport, Lane.ACTIVATION, p.ERROR, {}, meta={"message": str(exc)})
                raise
        _reply(transport, Lane.ACTIVATION, p.READY, {})
        while True:
            with inbox.next(timeout_s) as msg:
                if msg.kind == p.FORWARD:
                    _reply(transport, Lane.ACTIVATION, p.OUTPUT, state.forward(msg), msg=msg)
                elif msg.kind == p.BACKWARD:
                    _reply(transport, Lane.GRADIENT, p.GRAD, state.backward(msg), msg=msg)
                elif msg.kind == p.BYE:
                    state.run_ops(msg.meta.get("ops", []))
                    inbox.stop()
                    _reply(transport, Lane.ACTIVATION, p.CLOSED, {})
                    return transport.counters()
                else:
                    raise ProtocolError(f"unexpected frame {msg.kind!r} from the edge")
    except PeerLostError:
        log.warning("the edge left without sft.bye")
        raise
    finally:
        inbox.stop()
        transport.close()


def _reply(
    transport: TcpTransport,
    lane: Lane,
    kind: str,
    tensors: dict[str, torch.Tensor],
    *,
    msg: Message | None = None,
    meta: dict[str, Any] | None = None,
) -> None:
    priority = Priority.BACKWARD if lane is Lane.GRADIENT else Priority.FORWARD
    routing = msg.routing if msg is not None else None
    ticket = transport.send(p.EDGE, lane, kind, tensors, meta=meta, routing=routing,
                            priority=priority)  # fmt: skip
    ticket.wait()
