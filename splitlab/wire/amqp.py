"""RabbitMQ tensor transport (pika): the same frames as message bodies, kept to compare against.

Each peer owns two queues, `splitlab.<session>.<peer>.<lane>`, declared with AMQP priorities
and an hour's `x-expires`, deleted by their owner on close (never anyone else's) and by the
launcher once every node has exited (a node that died never closed). Every message carries
the connection's user as `user_id` (checked by the broker); logged in as its node user
(`splitlab.control.broker_users`), a transport drops, acked and said once, a message whose
`user_id` is not the user of the peer its `app_id` names. pika connections are not thread
safe, so every connection lives in the one thread that made it: a consumer thread per
transport (one channel per lane, `prefetch = queue_frames`, so each lane's receive queue is
bounded on its own) and a publisher thread per lane fed by a priority queue. Acks travel to the
consumer thread with `add_callback_threadsafe` when the user takes a message. The broker sits
between the peers, so a dead peer shows up only as a timeout here.

    SPLITLAB_REQUIRE_BROKER=1 .venv/bin/pytest tests/integration/test_wire_amqp.py -q
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pika
import torch

from splitlab.errors import PeerLostError, WaitTimeoutError
from splitlab.telemetry.trace import Tracer
from splitlab.wire.base import DEFAULT_TIMEOUT_S, Message, Priority, SendTicket, Transport
from splitlab.wire.broker_login import sender_user
from splitlab.wire.counters import WireCounters
from splitlab.wire.frame import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameHeader,
    Lane,
    Routing,
    decode_frame,
    encode_frame,
    frame_bytes,
)
from splitlab.wire.mailbox import Mailbox
from splitlab.wire.pool import BufferPool

log = logging.getLogger(__name__)

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
MAX_AMQP_PRIORITY = 10
QUEUE_EXPIRES_MS = 3_600_000  # unused for an hour, a queue goes (a killed launcher's leftovers)
_STOP = object()


def queue_name(session: str, peer_id: str, lane: Lane) -> str:
    return f"splitlab.{session}.{peer_id}.{lane.value}"


def session_queues(session: str, peer_ids: Iterable[str]) -> list[str]:
    """Every queue the peers `peer_ids` of `session` may have declared."""
    return [queue_name(session, peer, lane) for peer in peer_ids for lane in Lane]


def amqp_priority(priority: int) -> int:
    """Wire priorities go first when low; AMQP's when high."""
    return max(0, min(MAX_AMQP_PRIORITY, MAX_AMQP_PRIORITY - priority))


class AmqpTransport(Transport):
    def __init__(
        self,
        peer_id: str,
        *,
        session: str,
        url: str = DEFAULT_URL,
        queue_frames: int = 64,
        send_queue_frames: int = 64,
        pool_bytes: int = 256 << 20,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        check_finite: bool = False,
        timeout_s: float = 10.0,
        tracer: Tracer | None = None,
    ) -> None:
        self.peer_id, self.session, self.url = peer_id, session, url
        self.max_frame_bytes, self.check_finite = min(max_frame_bytes, pool_bytes), check_finite
        self.queue_frames, self.send_queue_frames = queue_frames, send_queue_frames
        self.tracer = tracer or Tracer.null()
        self._params = pika.URLParameters(url)
        self._user = self._params.credentials.username
        self._refused: set[tuple[str | None, str]] = set()
        self._counters = WireCounters()
        self._pools = {
            lane.value: BufferPool(pool_bytes=pool_bytes, name=lane.value) for lane in Lane
        }
        self._mailbox = Mailbox(max_frames=queue_frames + 1, name=f"amqp:{peer_id}")
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._consumer_conn: pika.BlockingConnection | None = None
        self._consumer = threading.Thread(
            target=self._consume, name=f"amqp-recv-{peer_id}", daemon=True
        )
        self._consumer.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self.close()
            raise PeerLostError(f"cannot reach the broker at {url}: {self._error}")
        self._seq = itertools.count()
        self._outboxes: dict[Lane, queue.PriorityQueue[tuple[int, int, Any]]] = {}
        self._publishers: dict[Lane, threading.Thread] = {}
        for lane in Lane:
            self._outboxes[lane] = queue.PriorityQueue(maxsize=send_queue_frames)
            self._publishers[lane] = threading.Thread(
                target=self._publish_loop,
                args=(lane,),
                name=f"amqp-send-{peer_id}-{lane.value}",
                daemon=True,
            )
            self._publishers[lane].start()

    @property
    def address(self) -> tuple[str, int]:
        return (self._params.host, self._params.port)

    # ---- consumer thread: owns one connection, one channel per lane ----
    def _consume(self) -> None:
        try:
            conn = pika.BlockingConnection(self._params)
            self._consumer_conn = conn
            consumers = []
            for lane in Lane:
                ch = conn.channel()
                ch.basic_qos(prefetch_count=self.queue_frames)
                name = queue_name(self.session, self.peer_id, lane)
                ch.queue_declare(name, arguments={"x-max-priority": MAX_AMQP_PRIORITY,
                                                  "x-expires": QUEUE_EXPIRES_MS})  # fmt: skip
                ch.queue_purge(name)
                tag = ch.basic_consume(name, functools.partial(self._on_message, lane),
                                       auto_ack=False)  # fmt: skip
                consumers.append((ch, tag))
        except Exception as exc:  # surfaced by __init__
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                conn.process_data_events(time_limit=0.05)
            for ch, tag in consumers:  # before the queues go: the broker would cancel them,
                ch.basic_cancel(tag)  # and closing would cancel them again, with a warning
            for lane in Lane:
                conn.channel().queue_delete(queue_name(self.session, self.peer_id, lane))
            conn.close()
        except Exception as exc:
            self._error = exc
            self._mailbox.close()
            log.warning("AMQP consumer of %r stopped: %s", self.peer_id, exc)

    def _on_message(self, lane: Lane, ch: Any, method: Any, props: Any, body: bytes) -> None:
        peer = props.app_id or "?"
        expected = sender_user(self.session, self._user, self.peer_id, peer)
        if expected is not None and props.user_id != expected:
            ch.basic_ack(method.delivery_tag)
            if (props.user_id, peer) not in self._refused:
                self._refused.add((props.user_id, peer))
                log.warning("%s: dropped a %s frame naming %r as sender from broker user %r",
                            self.peer_id, lane.value, peer, props.user_id)  # fmt: skip
            return
        prio = MAX_AMQP_PRIORITY - (props.priority or 0)
        self._mailbox.put(lane, peer, prio, (body, ch, method.delivery_tag), timeout_s=0)

    # ---- publisher threads: one connection each ----
    def _publish_loop(self, lane: Lane) -> None:
        outbox = self._outboxes[lane]
        conn = None
        try:
            conn = pika.BlockingConnection(self._params)
            ch = conn.channel()
            while True:
                try:
                    _, _, item = outbox.get(timeout=0.1)
                except queue.Empty:
                    conn.process_data_events(time_limit=0)  # heartbeats
                    continue
                if item is _STOP:
                    break
                routing_key, body, props, ticket = item
                try:
                    ch.basic_publish("", routing_key, body, props)
                except Exception as exc:
                    ticket.finish(PeerLostError(f"publish to {routing_key!r} failed: {exc}"))
                    raise
                self._counters.sent(lane, len(body))
                ticket.finish()
        except Exception as exc:
            log.warning("AMQP publisher %r/%s stopped: %s", self.peer_id, lane.value, exc)
        finally:
            if conn is not None and conn.is_open:
                conn.close()

    # ---- Transport ----
    def connect(
        self, peer_id: str, host: str = "", port: int = 0, *, timeout_s: float = 10.0
    ) -> None:
        """Wait until the peer's queues exist (publishing to a missing queue drops the message)."""
        deadline = time.monotonic() + timeout_s
        conn = pika.BlockingConnection(self._params)
        try:
            for lane in Lane:
                name = queue_name(self.session, peer_id, lane)
                while True:
                    try:
                        conn.channel().queue_declare(name, passive=True)
                        break
                    except pika.exceptions.ChannelClosedByBroker:
                        if time.monotonic() > deadline:
                            raise WaitTimeoutError(
                                f"peer {peer_id!r} has no queue {name!r} after timeout_s={timeout_s}"
                            ) from None
                        time.sleep(0.05)
        finally:
            conn.close()

    def send(
        self,
        peer_id: str,
        lane: Lane,
        kind: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        meta: dict[str, Any] | None = None,
        routing: Routing | None = None,
        priority: int = Priority.FORWARD,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> SendTicket:
        header = FrameHeader(
            kind=kind, lane=lane, routing=routing or Routing(session=self.session),
            src=self.peer_id, priority=int(priority), meta=meta or {},
        )  # fmt: skip
        body = frame_bytes(encode_frame(header, {k: t.cpu() for k, t in tensors.items()}))
        props = pika.BasicProperties(app_id=self.peer_id, user_id=self._user,
                                     priority=amqp_priority(int(priority)))  # fmt: skip
        ticket = SendTicket()
        item = (queue_name(self.session, peer_id, lane), body, props, ticket)
        try:
            self._outboxes[lane].put((int(priority), next(self._seq), item), timeout=timeout_s)
        except queue.Full:
            raise WaitTimeoutError(
                f"send to {peer_id!r}: {lane.value} outbox full for timeout_s={timeout_s}"
            ) from None
        return ticket

    def recv(
        self, lane: Lane, *, timeout_s: float = DEFAULT_TIMEOUT_S, peer_id: str | None = None
    ) -> Message:
        peer, (body, ch, tag) = self._mailbox.get(lane, timeout_s=timeout_s, peer=peer_id)
        conn = self._consumer_conn
        if conn is not None:
            conn.add_callback_threadsafe(functools.partial(ch.basic_ack, tag))
        header, tensors, lease = decode_frame(
            body, pool=self._pools[lane.value], max_frame_bytes=self.max_frame_bytes,
            check_finite=self.check_finite, timeout_s=timeout_s,
        )  # fmt: skip
        self._counters.received(lane, len(body))
        return Message(header, tensors, lease, peer)

    def counters(self) -> dict[str, Any]:
        return self._counters.snapshot(self._pools)

    def close(self) -> None:
        if self._stop.is_set():
            return
        for lane, outbox in getattr(self, "_outboxes", {}).items():
            outbox.put((1 << 62, next(self._seq), _STOP))  # after everything queued
            self._publishers[lane].join(timeout=10)
        self._stop.set()
        self._consumer.join(timeout=10)
        self._mailbox.close()
        self._counters.emit(self.tracer, self._pools, transport="amqp", peer=self.peer_id)
