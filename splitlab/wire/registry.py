"""The transport registry: `transport.name` -> how to open that data plane, and which tasks run it.

A transport kind is one `register_transport(name, open, tasks=...)` call. `open` takes the typed
`TransportConfig` plus the per-process facts (node id, session, data key, wait bound, the
broker's host for address discovery) and returns a `Transport`. `tasks` names the tasks whose
processes honour the option; `splitlab.choices` refuses any other task at validation time,
so a group option never silently runs something else.

    .venv/bin/pytest tests/unit/test_registries.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitlab.config.schema import TransportConfig
from splitlab.errors import ConfigError, registered

if TYPE_CHECKING:  # torch: config validation reads names only
    from splitlab.wire.base import Transport
    from splitlab.wire.delay import DelayLine


@dataclass(frozen=True, kw_only=True)
class TransportFacts:
    """What one process knows beyond the config: who it is and where its peers meet."""

    node_id: str
    session: str
    key: bytes  # per-session data-plane key (HMAC handshake; TCP only)
    timeout_s: float  # any single wait
    broker_host: str | None = None  # dial it to learn the routable address (TCP advertise)
    delay: DelayLine | None = None  # a testbed path's one-way delay (TCP only; no netem here)


Opener = Callable[[TransportConfig, TransportFacts], "Transport"]


@dataclass(frozen=True)
class TransportKind:
    open: Opener | None  # None: no process opens it from config (in-process only)
    tasks: frozenset[str]  # tasks whose processes run this transport


_TRANSPORTS: dict[str, TransportKind] = {}


def register_transport(name: str, open: Opener | None, *, tasks: frozenset[str]) -> None:
    """Make `transport=<name>` available to `tasks` (replaces an earlier registration)."""
    _TRANSPORTS[name] = TransportKind(open=open, tasks=frozenset(tasks))


def transports() -> dict[str, TransportKind]:
    """A copy of the registry."""
    return dict(_TRANSPORTS)


def transport_kind(name: str) -> TransportKind:
    """Raises ConfigError naming `transport.name` and the registered names."""
    return registered(_TRANSPORTS, name, "transport.name")


def open_transport(cfg: TransportConfig, facts: TransportFacts) -> Transport:
    """The data plane `cfg.name` names, opened for this process."""
    kind = transport_kind(cfg.name)
    if kind.open is None:
        raise ConfigError(f"transport={cfg.name} is in-process only: no process opens it")
    return kind.open(cfg, facts)


def _open_tcp(cfg: TransportConfig, facts: TransportFacts) -> Transport:
    from splitlab.wire.tcp import TcpTransport

    return TcpTransport(
        facts.node_id, key=facts.key, session=facts.session, bind_host=cfg.bind_host,
        port=cfg.port, advertise_host=cfg.advertise_host, broker_host=facts.broker_host,
        pool_bytes=cfg.pool_bytes, max_frame_bytes=cfg.max_frame_bytes,
        send_queue_frames=cfg.send_queue_frames, delay=facts.delay, spin_us=cfg.spin_us,
    )  # fmt: skip


def _open_amqp(cfg: TransportConfig, facts: TransportFacts) -> Transport:
    from splitlab.wire.amqp import AmqpTransport  # pulls in pika

    return AmqpTransport(
        facts.node_id, session=facts.session, url=cfg.url, timeout_s=facts.timeout_s,
        pool_bytes=cfg.pool_bytes, max_frame_bytes=cfg.max_frame_bytes,
        send_queue_frames=cfg.send_queue_frames,
    )  # fmt: skip


# The ring's stages dial each other over TCP; calibration probes links over TCP; analysis sends
# nothing, so every transport is fine there. Tensors over the broker for the ring, and every
# fine-tuning role as threads of one process over `inproc`, are not built (refused, not faked).
register_transport(
    "tcp", _open_tcp, tasks=frozenset({"finetune", "infer", "calibrate", "analyze", "sft_rank"})
)
register_transport("rabbitmq", _open_amqp, tasks=frozenset({"finetune", "analyze"}))
register_transport("inproc", None, tasks=frozenset({"analyze"}))
