"""The control bus interface both implementations honour, and the registry of bus kinds.

`register_bus(kind, connect, settings=..., tasks=...)` adds a kind: `connect` opens it from the
implementation's keyword arguments (`make_bus`), `settings` reads those that come from the
`control` config group (`open_bus`), and `tasks` names the tasks that honour `control=<kind>`
(`splitlab.choices` refuses the others before any process starts).

Semantics (RabbitMQ's, which the embedded bus copies):

- one queue per node per session, named `splitlab.<session>.<node_id>`; a publisher declares
  the destination queue, so a message sent before its consumer starts is kept;
- `publish` returns once the bus has taken the message (publisher confirm), or raises;
- `consume(timeout_s)` waits at most `timeout_s` and returns one `Delivery` or None;
  `consume_batch` returns everything already waiting (up to `max_count`), so a caller can
  look for an ABORT among all pending messages before acting on any;
- a delivery must be acked or nacked; unacked deliveries (nack with requeue, or the consumer
  closing or dying) are delivered again with `redelivered=True`;
- at most `prefetch` deliveries are unacked per consumer;
- a lost peer or broker is `PeerLostError`, a malformed message `ProtocolError`; nothing hangs;
- `cleanup` deletes only queues of this session: this node's, the ones it published to,
  and the node ids it is given. It never purges anything else.

One bus object belongs to one thread (pika's rule, kept for both).

    .venv/bin/pytest tests/integration/test_control_bus.py -q
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from splitlab.config.schema import ControlConfig
from splitlab.control.messages import BusMessage, decode
from splitlab.errors import ConfigError, registered

QUEUE_PREFIX = "splitlab"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_name(what: str, value: str) -> str:
    """Session and node ids become queue names: letters, digits, '_' and '-' only."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ConfigError(f"control {what} must match {_NAME_RE.pattern}, got {value!r}")
    return value


def queue_name(session: str, node_id: str) -> str:
    return f"{QUEUE_PREFIX}.{check_name('session', session)}.{check_name('node_id', node_id)}"


@dataclass(eq=False)
class Delivery:
    """One received message; `ack` or `nack` it exactly once."""

    message: BusMessage
    redelivered: bool
    _settle: Callable[[bool, bool], None] = field(repr=False)  # (ack, requeue)
    settled: bool = False

    def ack(self) -> None:
        self._settle_once(True, False)

    def nack(self, requeue: bool = True) -> None:
        self._settle_once(False, requeue)

    def _settle_once(self, ack: bool, requeue: bool) -> None:
        if self.settled:
            raise RuntimeError(f"delivery of {self.message.kind.value} was already acked or nacked")
        self.settled = True
        self._settle(ack, requeue)


class ControlBus(ABC):
    """Per-node queues with confirmed publish and manually acked consume."""

    session: str
    node_id: str
    timeout_s: float

    @abstractmethod
    def publish(self, to_node: str, msg: BusMessage, timeout_s: float | None = None) -> None:
        """Send `msg` to `to_node`'s queue and wait for the bus to confirm it."""

    @abstractmethod
    def consume_batch(self, max_count: int, timeout_s: float) -> list[Delivery]:
        """Wait up to `timeout_s` for a first delivery, then return all ready ones (<= max_count)."""

    def consume(self, timeout_s: float) -> Delivery | None:
        batch = self.consume_batch(1, timeout_s)
        return batch[0] if batch else None

    @abstractmethod
    def close(self) -> None:
        """Disconnect; unacked deliveries go back to the queue. Idempotent."""

    @abstractmethod
    def cleanup(self, node_ids: Iterable[str] = ()) -> None:
        """Delete this session's queues: own, published-to and `node_ids`'."""

    def __enter__(self) -> ControlBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_delivery(
    body: bytes, redelivered: bool, settle: Callable[[bool, bool], None]
) -> Delivery:
    """Decode a body into a Delivery; a malformed body is dropped (nack, no requeue) and raised."""
    try:
        msg = decode(body)
    except Exception:
        settle(False, False)  # a poison message must not come back forever
        raise
    return Delivery(message=msg, redelivered=redelivered, _settle=settle)


def _make_rabbitmq(**kwargs: Any) -> ControlBus:
    from splitlab.control.rabbitmq import RabbitMQBus

    return RabbitMQBus(**kwargs)


def _make_embedded(**kwargs: Any) -> ControlBus:
    from splitlab.control.embedded import EmbeddedBus

    return EmbeddedBus.connect(**kwargs)


def _rabbitmq_settings(cfg: ControlConfig) -> dict[str, Any]:
    return {"url": cfg.url, "prefetch": cfg.prefetch, "heartbeat_s": cfg.heartbeat_s}


def _embedded_settings(cfg: ControlConfig) -> dict[str, Any]:
    from splitlab.control.embedded import EmbeddedAddress

    address = EmbeddedAddress.from_env()  # the launcher hosts the bus and names it here
    return {"host": address.host, "port": address.port, "authkey": address.authkey,
            "prefetch": cfg.prefetch}  # fmt: skip


@dataclass(frozen=True)
class BusKind:
    connect: Callable[..., ControlBus]  # the implementation's keyword arguments
    settings: Callable[[ControlConfig], dict[str, Any]]  # those that come from `control.*`
    tasks: frozenset[str]  # tasks whose processes talk over this bus


_BUSES: dict[str, BusKind] = {}


def register_bus(
    kind: str,
    connect: Callable[..., ControlBus],
    *,
    settings: Callable[[ControlConfig], dict[str, Any]] = lambda cfg: {},
    tasks: frozenset[str] = frozenset({"finetune"}),
) -> None:
    """Make `control=<kind>` available to `tasks` (replaces an earlier registration)."""
    _BUSES[kind] = BusKind(connect=connect, settings=settings, tasks=frozenset(tasks))


def buses() -> dict[str, BusKind]:
    """A copy of the registry."""
    return dict(_BUSES)


def bus_kind(kind: str) -> BusKind:
    """Raises ConfigError naming `control.name` and the registered names."""
    return registered(_BUSES, kind, "control.name")


def make_bus(kind: str, **kwargs: Any) -> ControlBus:
    """Open a bus of `kind` from the implementation's own keyword arguments.

    rabbitmq: url, session, node_id, prefetch=16, timeout_s=30.0, heartbeat_s=10
    embedded: host, port, authkey, session, node_id, prefetch=16, timeout_s=30.0
    """
    return bus_kind(kind).connect(**kwargs)


def open_bus(cfg: ControlConfig, *, session: str, node_id: str, timeout_s: float) -> ControlBus:
    """Open the bus `control.name` names, with the `control.*` settings it reads."""
    kind = bus_kind(cfg.name)
    return kind.connect(session=session, node_id=node_id, timeout_s=timeout_s,
                        **kind.settings(cfg))  # fmt: skip


# The ring's stages run their barrier over the head's own control star, which needs no broker:
# that is what `embedded` means for them. The ring over the broker is not built (refused).
register_bus("embedded", _make_embedded, settings=_embedded_settings,
             tasks=frozenset({"finetune", "infer", "calibrate", "analyze", "sft_rank"}))  # fmt: skip
register_bus("rabbitmq", _make_rabbitmq, settings=_rabbitmq_settings,
             tasks=frozenset({"finetune", "analyze"}))  # fmt: skip
