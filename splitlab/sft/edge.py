"""The edge (data owner) side of the two-line API: a model whose middle runs on the cloud.

`SplitModel` keeps the embeddings, the blocks up to the split layer (the last one up to its
low-rank code) and, in U-shape, the tail and head; its forward sends the crossing tensors to
the cloud inside an autograd function whose backward sends their gradients back, so a plain
`loss.backward()` drives the cloud's backward too. `SFTOptimizer` wraps the edge's optimizer
and queues the cloud's step / zero_grad into the next frame (no frames of their own).

    .venv/bin/python examples/sft_two_lines.py
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splitlab.errors import ConfigError, ProtocolError
from splitlab.models.families import family_for_model
from splitlab.models.lowrank import decompose_plan
from splitlab.models.parts import Part, build_parts, crossing_names, group
from splitlab.models.tokens import positions_from_pad_mask
from splitlab.sft import protocol as p
from splitlab.wire import Lane, Message, Priority, Routing, TcpTransport


@dataclass
class SplitOutput:
    """What `SplitModel.forward` returns (named like a transformers output)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class _Link:
    """The edge's end of the protocol: one request, one answer, on a TcpTransport."""

    def __init__(self, transport: TcpTransport, *, session: str, timeout_s: float) -> None:
        self.transport, self.session, self.timeout_s = transport, session, timeout_s
        self.ops: list[dict[str, Any]] = []  # queued cloud optimizer calls
        self._ids = itertools.count()

    def request(
        self, lane: Lane, kind: str, tensors: Mapping[str, torch.Tensor], *, expect: str,
        microbatch: int | None = None, meta: dict[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        routing = Routing(session=self.session, microbatch=microbatch)
        priority = Priority.BACKWARD if lane is Lane.GRADIENT else Priority.FORWARD
        ticket = self.transport.send(p.CLOUD, lane, kind, tensors, meta=meta, routing=routing,
                                     priority=priority, timeout_s=self.timeout_s)  # fmt: skip
        ticket.wait(self.timeout_s)
        with self.transport.recv(lane, timeout_s=self.timeout_s, peer_id=p.CLOUD) as msg:
            return _answer(msg, expect)

    def forward(
        self, tensors: Mapping[str, torch.Tensor], pad_mask_BT: torch.Tensor, *, grad: bool,
        training: bool,
    ) -> tuple[int, dict[str, torch.Tensor]]:  # fmt: skip
        microbatch = next(self._ids)
        frame = {name: t.detach().contiguous() for name, t in tensors.items()}
        frame[p.PAD_MASK] = pad_mask_BT.to(torch.bool).contiguous()
        meta = {"grad": grad, "training": training, "ops": self.ops}
        self.ops = []
        out = self.request(Lane.ACTIVATION, p.FORWARD, frame, expect=p.OUTPUT,
                           microbatch=microbatch, meta=meta)  # fmt: skip
        return microbatch, out

    def backward(self, microbatch: int, grads: Mapping[str, torch.Tensor]) -> dict:
        frame = {name: g.contiguous() for name, g in grads.items()}
        return self.request(Lane.GRADIENT, p.BACKWARD, frame, expect=p.GRAD, microbatch=microbatch)


def _answer(msg: Message, expect: str) -> dict[str, torch.Tensor]:
    if msg.kind == p.ERROR:
        raise ConfigError(f"the cloud refused: {msg.meta.get('message')}")
    if msg.kind != expect:
        raise ProtocolError(f"expected {expect} from the cloud, got {msg.kind!r}")
    return {name: t.clone() for name, t in msg.tensors.items()}


class _Remote(torch.autograd.Function):
    """The cloud's part as one autograd node: forward and backward are round trips."""

    @staticmethod
    def forward(ctx: Any, link: _Link, names: tuple[str, ...], out_names: tuple[str, ...],
                pad_mask_BT: torch.Tensor, training: bool, anchor: torch.Tensor,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
        microbatch, out = link.forward(
            dict(zip(names, tensors, strict=True)), pad_mask_BT, grad=True, training=training
        )
        ctx.link, ctx.microbatch, ctx.names, ctx.out_names = link, microbatch, names, out_names
        return tuple(out[name] for name in out_names)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = ctx.link.backward(ctx.microbatch, dict(zip(ctx.out_names, grads, strict=True)))
        return (None,) * 6 + tuple(back[name] for name in ctx.names)


class SplitModel(nn.Module):
    """The edge's share of a model split with the cloud (see `splitlab.sft.split`).

    `parameters()` are the edge's own (front, tail and head); `state_dict()` keeps the
    upstream keys (`bert.embeddings...`, `...intermediate.dense.lowrank_in.weight`).
    """

    def __init__(self, model: nn.Module, spec: p.SplitSpec, transport: TcpTransport,
                 *, session: str, timeout_s: float) -> None:  # fmt: skip
        super().__init__()
        self.spec, self.adapter = spec, family_for_model(model)
        plan = spec.plan()
        decompose_plan(model, plan, adapter=self.adapter)
        parts = build_parts(model, plan, adapter=self.adapter)
        # A tuple, not attributes: `owner` below registers these modules once, upstream keys.
        self._parts: tuple[Part, Part | None] = (parts[0], parts[2] if len(parts) == 3 else None)
        self._aux = nn.ModuleList([part.aux for part in parts[::2]])  # rotary tables follow .to()
        self.owner = group(parts[::2])
        self.sends = crossing_names(plan.front.code_out)
        self.receives = (p.LOGITS,) if len(parts) == 2 else crossing_names(plan.body.code_out)
        self.transport = transport
        self.link = _Link(transport, session=session, timeout_s=timeout_s)
        factors = {k: v.detach() for k, v in model.state_dict().items() if ".lowrank_" in k}
        self.link.request(Lane.ACTIVATION, p.HELLO, factors, expect=p.READY, meta=spec.to_dict())

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.owner.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ):
        return self.owner.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> SplitOutput:
        """Front here, body on the cloud, tail (U-shape) here; the loss if `labels` is given
        (targets as the family's adapter reads them: class ids, or ids with -100 ignored)."""
        pad_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        positions = positions_from_pad_mask(pad_mask)
        front, tail = self._parts
        out = front(input_ids, pad_mask, positions)
        sent = out if isinstance(out, Mapping) else {self.sends[0]: out}
        tensors = [sent[name] for name in self.sends]
        if torch.is_grad_enabled():
            anchor = torch.empty(0, requires_grad=True)  # backward reaches the cloud even when
            got = _Remote.apply(  # nothing on the edge before the cut is trainable
                self.link, self.sends, self.receives, pad_mask, self.training, anchor, *tensors
            )
            back = dict(zip(self.receives, got, strict=True))
        else:
            _, back = self.link.forward(sent, pad_mask, grad=False, training=self.training)
        if tail is None:
            logits = back[p.LOGITS]
        else:
            x = back if tail.span.code_in is not None else back[self.receives[0]]
            logits = tail(x, pad_mask, positions)
        loss = None if labels is None else self.adapter.loss(logits, labels)
        return SplitOutput(logits=logits, loss=loss)

    def counters(self) -> dict[str, Any]:
        """The transport's frame and byte counters (both lanes, both directions)."""
        return self.transport.counters()

    def close(self) -> None:
        """Hand the queued optimizer calls to the cloud, end its session, close the link."""
        if self.link is None:
            return
        try:
            self.link.request(Lane.ACTIVATION, p.BYE, {}, expect=p.CLOSED,
                              meta={"ops": self.link.ops})  # fmt: skip
        finally:
            self.transport.close()
            self.link = None  # type: ignore[assignment]


class SFTOptimizer:
    """Wraps the edge's optimizer; `step` and `zero_grad` also run on the cloud.

    The cloud's calls travel in the next frame (the next forward, or `close()`), before the
    cloud uses its parameters again, so no frame is spent on them. Each step carries the
    edge's learning rates, so a scheduler on the wrapped optimizer drives both sides.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: SplitModel) -> None:
        self.optimizer, self.model = optimizer, model

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> Any:
        result = self.optimizer.step(closure)
        lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.model.link.ops.append({"op": "step", "lr": lrs})
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.model.link.ops.append({"op": "zero_grad", "set_to_none": set_to_none})

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()
