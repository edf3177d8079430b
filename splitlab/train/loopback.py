"""One U-shape owner and one worker in two threads of this process, over real loopback TCP.

The owner and worker schedulers (`splitlab.train.owner`, `splitlab.train.worker`) run as in a
distributed run: each node has its own TCP endpoint (with the session handshake) and its own
connection to an embedded control bus; only frames and control messages connect them. The
transports' frame counters are read at the end, so the bytes a cut costs are measured on the
wire, never computed. Used by the low-rank cut tests and `experiments/sft_rank/run.py`.

    .venv/bin/pytest tests/equivalence/test_train_sft_tcp.py -q
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from splitlab.control.bus import make_bus
from splitlab.control.embedded import EmbeddedBusServer
from splitlab.control.endpoint import ControlEndpoint
from splitlab.train.nodes import Batch, OwnerNode, WorkerNode
from splitlab.train.owner import OwnerScheduler, SchedulerSettings
from splitlab.train.window import effective_credit
from splitlab.train.worker import WorkerScheduler
from splitlab.train.wrr import AdaptiveWeights
from splitlab.wire.tcp import TcpTransport

# The longest a window may take: past it a node is taken to hang. A backstop for waits the
# schedulers do not time out themselves; it counts from the last window either node finished,
# not from the start, so a long run on a starved host (a study beside other work) goes on.
STALL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class LoopbackResult:
    losses: list[float]  # the owner's microbatch losses, in forward order
    owner_counters: dict[str, Any]  # `Transport.counters()` of the owner's endpoint
    worker_counters: dict[str, Any]


def run_loopback(
    owner: OwnerNode,
    worker: WorkerNode,
    windows: Sequence[Sequence[Batch]],
    *,
    settings: SchedulerSettings | None = None,
    pool_bytes: int = 64 << 20,
    on_window: Callable[[int], None] | None = None,
) -> LoopbackResult:
    """Train `owner` and `worker` on `windows` (one list of microbatches per window).

    Args:
        on_window: called by the owner thread after each window (e.g. to time or evaluate).

    Raises:
        the first node's error (the other node aborts through the bus), or RuntimeError when
        neither node finished a window for STALL_TIMEOUT_S.
    """
    settings = settings or SchedulerSettings(max_inflight=2, timeout_s=60.0)
    session = f"s{uuid.uuid4().hex[:10]}"
    key = secrets.token_bytes(32)
    server = EmbeddedBusServer()
    address = server.start()
    transports = {
        name: TcpTransport(name, key=key, session=session, pool_bytes=pool_bytes)
        for name in (owner.name, worker.name)
    }
    transports[owner.name].connect(worker.name, *transports[worker.name].address)
    credit = effective_credit(
        max_inflight=settings.max_inflight, worker_max_inflight=8, num_owners=1
    )
    losses: list[float] = []
    errors: dict[str, BaseException] = {}
    progress = [time.monotonic()]  # when a node last finished a window

    def control(name: str) -> ControlEndpoint:
        bus = make_bus(
            "embedded", host=address.host, port=address.port, authkey=address.authkey,
            session=session, node_id=name, timeout_s=30.0,
        )  # fmt: skip
        return ControlEndpoint(bus)

    def owner_main() -> None:
        ctl = control(owner.name)
        try:
            scheduler = OwnerScheduler(
                node=owner, transport=transports[owner.name], control=ctl,
                workers=[worker.name], weights=AdaptiveWeights({worker.name: 1.0}, adaptive=False),
                settings=settings,
            )  # fmt: skip
            for window_id, batches in enumerate(windows):
                losses.extend(scheduler.run_window(window_id, list(batches)))
                progress[0] = time.monotonic()
                if on_window is not None:
                    on_window(window_id)
        finally:
            ctl.close()

    def worker_main() -> None:
        ctl = control(worker.name)
        try:
            scheduler = WorkerScheduler(
                node=worker, transport=transports[worker.name], control=ctl,
                owners=[owner.name], credit=credit, worker_max_inflight=8, settings=settings,
            )  # fmt: skip
            for window_id in range(len(windows)):
                scheduler.run_window(window_id)
                progress[0] = time.monotonic()
        finally:
            ctl.close()

    def guarded(name: str, main: Callable[[], None]) -> threading.Thread:
        def body() -> None:
            try:
                main()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors[name] = exc

        return threading.Thread(target=body, name=f"loopback-{name}", daemon=True)

    threads = [guarded(owner.name, owner_main), guarded(worker.name, worker_main)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=1.0)
                if thread.is_alive() and time.monotonic() - progress[0] > STALL_TIMEOUT_S:
                    raise RuntimeError(
                        f"{thread.name}: no window finished in {STALL_TIMEOUT_S:.0f} s "
                        f"({len(losses)} microbatches done of {sum(map(len, windows))})"
                    )
        if errors:
            raise next(iter(errors.values()))
        return LoopbackResult(
            losses,
            transports[owner.name].counters(),
            transports[worker.name].counters(),
        )
    finally:
        for transport in transports.values():
            transport.close()
        server.close()
