"""Owner and worker schedulers over a real transport and control bus, one thread per node.

Every node has its own model replica, transport endpoint and control-bus connection (opened in
its own thread, as pika requires); only frames and control messages connect them.

.venv/bin/pytest tests/equivalence/test_train_schedulers.py -q
"""

from __future__ import annotations

import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from model_helpers import tiny_model, twin
from test_train_engine import (
    WINDOW,
    adamw,
    assert_same_parameters,
    batches,
    train_unsplit,
    train_unsplit_token_weighted,
)
from torch import nn

from splitlab.config.enums import Objective
from splitlab.control.bus import make_bus
from splitlab.control.embedded import EmbeddedBusServer
from splitlab.control.endpoint import ControlEndpoint
from splitlab.errors import AbortedError, NonFiniteError
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.telemetry.records import Record
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.owner import OwnerScheduler, SchedulerSettings
from splitlab.train.window import effective_credit, round_schedule
from splitlab.train.worker import WorkerScheduler
from splitlab.train.wrr import AdaptiveWeights, SmoothWRR
from splitlab.wire.base import Transport
from splitlab.wire.inproc import InProcHub, InProcTransport
from splitlab.wire.tcp import TcpTransport

PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)
SETTINGS = SchedulerSettings(max_inflight=2, timeout_s=20.0)


@dataclass
class Group:
    """A whole U-shape group in threads; `run` returns once every node finished or failed."""

    base: nn.Module
    data: dict[str, list[dict[str, torch.Tensor]]]
    weights: dict[str, float]
    quota: int = WINDOW
    adaptive: bool = False  # owners re-weight WRR from the workers' COMMIT throughput
    transport: str = "inproc"  # or "tcp": real loopback sockets with the session handshake
    settings: SchedulerSettings = SETTINGS
    owners: dict[str, OwnerNode] = field(default_factory=dict)
    workers: dict[str, WorkerNode] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for name in self.data:
            front, _, tail = build_parts(twin(self.base), PLAN)
            self.owners[name] = OwnerNode(
                name, front, tail, adamw(partition_parameters(front, tail))
            )
        for name in self.weights:
            _, body, _ = build_parts(twin(self.base), PLAN)
            self.workers[name] = WorkerNode(name, body, adamw(partition_parameters(body)))

    def emit(self, record: Record) -> None:
        with self.lock:
            self.events.append(record.to_dict())

    def _transports(self, session: str) -> dict[str, Transport]:
        names = [*self.owners, *self.workers]
        if self.transport == "inproc":
            hub = InProcHub()
            return {n: InProcTransport(n, hub, session=session) for n in names}
        key = secrets.token_bytes(32)
        transports: dict[str, Transport] = {
            n: TcpTransport(n, key=key, session=session, pool_bytes=16 << 20) for n in names
        }
        for owner in self.owners:  # owners dial every worker of the group
            for worker in self.workers:
                transports[owner].connect(worker, *transports[worker].address)
        return transports

    def run(self) -> None:
        session = f"t{uuid.uuid4().hex[:10]}"
        server = EmbeddedBusServer()
        address = server.start()
        transports = self._transports(session)
        schedule = round_schedule({o: len(b) for o, b in self.data.items()}, self.quota)
        credit = effective_credit(
            max_inflight=SETTINGS.max_inflight, worker_max_inflight=8, num_owners=len(self.owners)
        )

        def control(name: str) -> ControlEndpoint:
            bus = make_bus(
                "embedded", host=address.host, port=address.port, authkey=address.authkey,
                session=session, node_id=name, timeout_s=10.0,
            )  # fmt: skip
            return ControlEndpoint(bus)

        def owner_main(name: str) -> None:
            ctl = control(name)
            try:
                scheduler = OwnerScheduler(
                    node=self.owners[name], transport=transports[name], control=ctl,
                    workers=list(self.workers), weights=AdaptiveWeights(self.weights, adaptive=self.adaptive),
                    settings=self.settings, emit=self.emit,
                )  # fmt: skip
                start = 0
                for window_id, counts in enumerate(schedule):
                    chunk = self.data[name][start : start + counts[name]]
                    start += counts[name]
                    scheduler.run_window(window_id, chunk)
            finally:
                ctl.close()

        def worker_main(name: str) -> None:
            ctl = control(name)
            try:
                scheduler = WorkerScheduler(
                    node=self.workers[name], transport=transports[name], control=ctl,
                    owners=list(self.owners), credit=credit, worker_max_inflight=8,
                    settings=self.settings, emit=self.emit,
                )  # fmt: skip
                for window_id in range(len(schedule)):
                    scheduler.run_window(window_id)
            finally:
                ctl.close()

        def guarded(name: str, main: Callable[[str], None]) -> Callable[[], None]:
            def body() -> None:
                try:
                    main(name)
                except BaseException as exc:  # noqa: BLE001 - collected for the test to inspect
                    self.errors[name] = exc

            return body

        threads = [threading.Thread(target=guarded(n, owner_main)) for n in self.owners]
        threads += [threading.Thread(target=guarded(n, worker_main)) for n in self.workers]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
                assert not thread.is_alive(), "a node thread hung"
        finally:
            for transport in transports.values():
                transport.close()
            server.close()


def split_model(group: Group) -> nn.Module:
    """The 1 x 1 group's parameters assembled back under the unsplit model's names."""
    (owner,) = group.owners.values()
    (worker,) = group.workers.values()
    model = twin(group.base)
    state = {**owner.state_dict(), **worker.state_dict()}
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_one_owner_one_worker_matches_unsplit_over_the_transport(
    family: str, transport: str
) -> None:
    base = tiny_model(family)
    ref = twin(base)
    data = batches(family)
    group = Group(base, {"o0": data}, {"w0": 1.0}, transport=transport)

    train_unsplit(ref, family, data)
    group.run()

    assert group.errors == {}
    assert_same_parameters(ref, split_model(group))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_token_weighted_objective_over_tcp_matches_the_unsplit_token_sum(family: str) -> None:
    base = tiny_model(family)
    ref = twin(base)
    data = batches(family)  # uneven target counts per microbatch
    settings = SchedulerSettings(max_inflight=2, timeout_s=20.0, objective=Objective.token_weighted)
    group = Group(base, {"o0": data}, {"w0": 1.0}, transport="tcp", settings=settings)

    train_unsplit_token_weighted(ref, family, data)
    group.run()

    assert group.errors == {}
    assert_same_parameters(ref, split_model(group))


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_three_owners_two_workers_split_and_barrier_order(transport: str) -> None:
    data = {"o0": batches("gpt2", n=5), "o1": batches("gpt2", n=2, seed=40), "o2": []}
    group = Group(tiny_model("gpt2"), data, {"w0": 3.0, "w1": 1.0}, transport=transport)

    group.run()

    assert group.errors == {}
    for owner, items in data.items():
        pinned = [
            e["worker"] for e in group.events if e["kind"] == "forward" and e["owner"] == owner
        ]
        assert sorted(pinned) == sorted(SmoothWRR({"w0": 3.0, "w1": 1.0}).assign(len(items)))
    for window in (0, 1):
        order = [e["kind"] for e in group.events if e.get("window") == window]
        last_drained = max(i for i, k in enumerate(order) if k == "drained")
        commits = [i for i, k in enumerate(order) if k == "commit"]
        assert len(commits) == 2 and min(commits) > last_drained
        assert all(i > min(commits) for i, k in enumerate(order) if k == "step")
    assert [n.num_samples for n in group.owners.values()][2] == 0
    assert sum(w.num_samples for w in group.workers.values()) == sum(
        o.num_samples for o in group.owners.values()
    )


def test_non_finite_body_aborts_every_node_naming_the_worker() -> None:
    group = Group(
        tiny_model("gpt2"), {"o0": batches("gpt2", n=3), "o1": batches("gpt2", n=3)}, {"w0": 1.0}
    )
    with torch.no_grad():
        next(group.workers["w0"].body.parameters()).fill_(float("nan"))

    group.run()

    assert isinstance(group.errors["w0"], NonFiniteError)
    for owner in ("o0", "o1"):
        assert isinstance(group.errors[owner], AbortedError), group.errors.get(owner)
        assert "'w0'" in str(group.errors[owner]) and "NonFiniteError" in str(group.errors[owner])


def test_adaptive_weights_follow_commit_throughput_over_the_bus() -> None:
    data = {"o0": batches("llama", n=12)}
    group = Group(tiny_model("llama"), data, {"w0": 1.0, "w1": 1.0}, quota=4, adaptive=True)
    for name, seconds in (("w0", 1.0), ("w1", 4.0)):  # fake body seconds per forward
        now = [0.0]
        worker = group.workers[name]
        worker.body.register_forward_hook(lambda *_, n=now, s=seconds: n.__setitem__(0, n[0] + s))
        worker.clock = lambda n=now: n[0]

    group.run()

    assert group.errors == {}
    plans = [e["counts_by_worker"] for e in group.events if e["kind"] == "plan"]
    assert plans[0] == {"w0": 2, "w1": 2}  # configured 1:1 until both are measured
    assert plans[2]["w0"] >= 3  # then about 4:1 by measured tokens per second
    commits = [e for e in group.events if e["kind"] == "commit" and e["window"] == 0]
    rates = {e["worker"]: e["tokens_per_s"] for e in commits}
    assert rates["w0"] > 3.0 * rates["w1"]
