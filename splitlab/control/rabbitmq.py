"""RabbitMQ control bus (pika `BlockingConnection`): what runs across hosts.

- broker URL from config, `amqp://user:pass@host:port/vhost` (URL-encode `/` as `%2F`);
- publisher confirms (`confirm_delivery`, `mandatory=True`): `publish` returns once the
  broker has the message, and raises if it was refused or unroutable;
- manual acks with a `prefetch` bound (`basic_qos`);
- queues `splitlab.<session>.<node_id>`: non-durable, not exclusive (a restarted node finds
  its queue and its unacked messages again) and with `x-expires`, so the queues of a run
  whose launcher was killed vanish by themselves; otherwise the launcher deletes them (and
  the tensor transport's) by exact name once every node has exited (`delete_queues`);
- nothing hangs: heartbeats detect a dead broker, `blocked_connection_timeout` bounds a
  broker in flow control, `socket_timeout` / `stack_timeout` bound connecting, and every
  pika connection failure becomes `PeerLostError` naming the broker (never the password).

Every publish carries the connection's user as the AMQP `user_id`, which the broker refuses
unless it is that user. Logged in as its node user (`control.node_users`,
`splitlab.control.broker_users`), a node publishes without declaring the destination (the
launcher declared every control queue; a node may declare only its own) and drops, acked and
said once per sender, any delivery whose `user_id` is not the user of the `sender` it names.

One connection per thread, created in that thread: a bus checks that it is used by the
thread that opened it. The connection is named `splitlab.<session>.<node_id>` on the broker
(`rabbitmqctl list_connections client_properties`).

    SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_control_bus.py -m rabbitmq -q
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, NoReturn
from urllib.parse import quote

import pika
import pika.exceptions

from splitlab.control.bus import ControlBus, Delivery, check_name, decode_delivery, queue_name
from splitlab.control.messages import BusMessage, encode
from splitlab.errors import ConfigError, PeerLostError
from splitlab.wire.broker_login import sender_user

log = logging.getLogger(__name__)

_CONTENT_TYPE = "application/x-splitlab-control"
QUEUE_EXPIRES_S = 3600.0  # unused for an hour, a control queue goes (a killed launcher's)


def control_queue_args(queue_expires_s: float = QUEUE_EXPIRES_S) -> dict[str, int]:
    """The arguments every control queue is declared with (the broker refuses a second
    declaration with others)."""
    return {"x-expires": int(queue_expires_s * 1000)}


def broker_label(params: pika.ConnectionParameters) -> str:
    """`amqp://host:port/vhost`, for messages (no credentials)."""
    return f"amqp://{params.host}:{params.port}/{quote(params.virtual_host, safe='')}"


class RabbitMQBus(ControlBus):
    """A node's queue and connection on a RabbitMQ broker."""

    def __init__(
        self,
        *,
        url: str,
        session: str,
        node_id: str,
        prefetch: int = 16,
        timeout_s: float = 30.0,
        heartbeat_s: int = 10,
        queue_expires_s: float = QUEUE_EXPIRES_S,
    ) -> None:
        self.session, self.node_id, self.timeout_s = session, node_id, timeout_s
        self._queue = queue_name(check_name("session", session), check_name("node_id", node_id))
        try:
            params = pika.URLParameters(url)
        except Exception as exc:
            raise ConfigError(f"control.url is not an AMQP URL: {exc}") from None
        params.heartbeat = heartbeat_s
        params.blocked_connection_timeout = timeout_s
        params.socket_timeout = min(timeout_s, 10.0)
        params.stack_timeout = timeout_s
        params.connection_attempts = 3
        params.retry_delay = 1.0
        params.client_properties = {"connection_name": self._queue}
        self.broker = broker_label(params)
        self._queue_args = control_queue_args(queue_expires_s)
        self._user = params.credentials.username
        self._node_user = sender_user(session, self._user, node_id, node_id) is not None
        self._refused: dict[tuple[str | None, str], int] = {}  # (user_id, sender) -> dropped
        self._ready: deque[tuple[int, bool, bytes, str | None]] = deque()
        self._declared: set[str] = set()
        self._consuming = False
        self._lost: str | None = None
        self._thread = threading.get_ident()
        try:
            self._conn = pika.BlockingConnection(params)
            self._channel = self._conn.channel()
            self._channel.confirm_delivery()
            self._channel.basic_qos(prefetch_count=prefetch)
            self._declare(self._queue)
        except pika.exceptions.AMQPError as exc:
            self._lose(f"cannot open a session on the RabbitMQ broker {self.broker}", exc)

    def publish(self, to_node: str, msg: BusMessage, timeout_s: float | None = None) -> None:
        """Confirmed publish. pika cannot bound a confirm wait by `timeout_s`; heartbeats
        (about 2 x heartbeat_s) and `blocked_connection_timeout` bound it instead."""
        self._check()
        name = queue_name(self.session, to_node)
        try:
            if not self._node_user:
                self._declare(name)
            self._channel.basic_publish(
                exchange="",
                routing_key=name,
                body=encode(msg),
                properties=pika.BasicProperties(
                    content_type=_CONTENT_TYPE, delivery_mode=1, user_id=self._user
                ),
                mandatory=True,
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            raise PeerLostError(
                f"broker {self.broker} refused {msg.kind.value} to {name}: {exc!r}"
            ) from None
        except pika.exceptions.AMQPError as exc:
            self._lose(f"lost the RabbitMQ broker {self.broker} publishing to {name}", exc)

    def consume_batch(self, max_count: int, timeout_s: float) -> list[Delivery]:
        self._check()
        deadline = time.monotonic() + max(0.0, timeout_s)
        out: list[Delivery] = []
        while not out:  # a batch of dropped deliveries (`_from_its_sender`) waits on
            if not self._wait_ready(deadline):
                return []
            while self._ready and len(out) < max_count:
                tag, redelivered, body, user_id = self._ready.popleft()
                delivery = decode_delivery(body, redelivered, self._settler(tag))
                if self._from_its_sender(delivery.message.sender, user_id):
                    out.append(delivery)
                else:
                    delivery.ack()
        return out

    def _wait_ready(self, deadline: float) -> bool:
        """Until a delivery is ready (True) or `deadline` (False)."""
        try:
            if not self._consuming:
                self._channel.basic_consume(self._queue, self._on_message, auto_ack=False)
                self._consuming = True
            # process_data_events returns as soon as a callback is ready to dispatch.
            self._conn.process_data_events(time_limit=0)
            while not self._ready:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    return False
                self._conn.process_data_events(time_limit=remaining_s)
        except pika.exceptions.AMQPError as exc:
            self._lose(f"lost the RabbitMQ broker {self.broker} consuming {self._queue}", exc)
        return True

    def _from_its_sender(self, sender: str, user_id: str | None) -> bool:
        """Under a node login, the broker-checked `user_id` must be `sender`'s node user."""
        expected = sender_user(self.session, self._user, self.node_id, sender)
        if expected is None or user_id == expected:
            return True
        key = (user_id, sender)
        if key not in self._refused:
            log.warning("%s: dropped a message naming %r as sender from broker user %r "
                        "(its user is %r)", self.node_id, sender, user_id, expected)  # fmt: skip
        self._refused[key] = self._refused.get(key, 0) + 1
        return False

    def close(self) -> None:
        if self._lost is not None and self._conn.is_closed:
            return
        try:
            if self._conn.is_open:
                self._conn.close()
        except pika.exceptions.AMQPError as exc:
            log.debug("closing the connection to %s: %r", self.broker, exc)
        self._lost = self._lost or "closed"

    def cleanup(self, node_ids: Iterable[str] = ()) -> None:
        self._check()
        names = {self._queue, *self._declared, *(queue_name(self.session, n) for n in node_ids)}
        if self._node_user:  # may delete only its own; the launcher removes the vhost
            names = {self._queue}
        try:
            for name in sorted(names):
                self._channel.queue_delete(queue=name)
        except pika.exceptions.AMQPError as exc:
            self._lose(f"lost the RabbitMQ broker {self.broker} deleting queues", exc)
        self._declared.clear()

    def connection_name(self) -> str:
        return self._queue

    def _declare(self, name: str) -> None:
        if name not in self._declared:
            self._channel.queue_declare(
                queue=name,
                durable=False,
                exclusive=False,
                auto_delete=False,
                arguments=self._queue_args,
            )
            self._declared.add(name)

    def _on_message(self, _ch: Any, method: Any, props: Any, body: bytes) -> None:
        self._ready.append((method.delivery_tag, bool(method.redelivered), body, props.user_id))

    def _settler(self, tag: int) -> Any:
        def settle(ack: bool, requeue: bool) -> None:
            if self._lost is not None:
                return  # the broker requeued it when the connection went
            try:
                if ack:
                    self._channel.basic_ack(tag)
                else:
                    self._channel.basic_nack(tag, requeue=requeue)
            except pika.exceptions.AMQPError as exc:
                self._lose(f"lost the RabbitMQ broker {self.broker} settling a delivery", exc)

        return settle

    def _check(self) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "a RabbitMQBus is used only by the thread that opened it (pika's rule)"
            )
        if self._lost is not None:
            raise PeerLostError(f"connection of {self.node_id!r} to {self.broker} is {self._lost}")

    def _lose(self, what: str, exc: BaseException) -> NoReturn:
        self._lost = f"lost ({exc!r})"
        raise PeerLostError(f"{what}: {exc!r}") from None


def delete_queues(url: str, names: Iterable[str], *, timeout_s: float = 10.0) -> int:
    """Delete the queues `names` (exact names; a missing one is no error on RabbitMQ) over one
    short connection; returns how many it deleted. The launcher removes a session's queues
    with it once every node has exited, whatever their exit.

    Raises:
        PeerLostError: naming the broker (never the password) when it cannot be reached.
    """
    params = pika.URLParameters(url)
    params.socket_timeout = params.stack_timeout = params.blocked_connection_timeout = timeout_s
    params.connection_attempts = 1
    names = sorted(set(names))
    try:
        conn = pika.BlockingConnection(params)
        try:
            channel = conn.channel()
            for name in names:
                channel.queue_delete(queue=name)
        finally:
            if conn.is_open:
                conn.close()
    except pika.exceptions.AMQPError as exc:
        raise PeerLostError(f"cannot delete queues on {broker_label(params)}: {exc!r}") from None
    return len(names)
