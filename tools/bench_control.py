"""PLAN -> OPEN round trip on the embedded bus and on RabbitMQ, alternating, in one run.

The bench process plays the launcher (it hosts the embedded bus) and the owner; one worker
process per bus answers every PLAN with an OPEN. Both go through `ControlEndpoint`, so the
time includes encode, confirm, delivery rules and ack. Repetitions alternate between the
buses so machine noise hits both. Targets: embedded median <= 1 ms, RabbitMQ <= 5 ms.

    .venv/bin/python tools/bench_control.py --quick --out /tmp/bench_control.json
    .venv/bin/python tools/bench_control.py --bus embedded --quick
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitlab.control.bus import make_bus  # noqa: E402
from splitlab.control.embedded import EmbeddedBusServer  # noqa: E402
from splitlab.control.endpoint import ControlEndpoint  # noqa: E402
from splitlab.control.messages import Kind, Open, Plan  # noqa: E402
from splitlab.errors import (
    PeerLostError,  # noqa: E402
    tool_exit,
)
from splitlab.telemetry.bench import BenchReport, bench_arg_parser, median, percentile  # noqa: E402
from splitlab.telemetry.log import leave

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
GOALS_MS = {"embedded": 1.0, "rabbitmq": 5.0}


def _worker(kind: str, kwargs: dict[str, Any], num_windows: int) -> None:
    """Answer PLAN(w) with OPEN(w) for w = 0 .. num_windows-1."""
    ep = ControlEndpoint(make_bus(kind, node_id="w0", **kwargs))
    for w in range(num_windows):
        ep.advance(w)
        plan = ep.wait_for((Kind.PLAN,), 60.0)
        ep.send(
            "o0", Open(session_id=ep.session, sender="w0", window_id=w, group_total=1, credit=1)
        )
        assert plan.window_id == w
    ep.close()


def _round_trips_ms(owner: ControlEndpoint, first_window: int, count: int) -> list[float]:
    out = []
    for w in range(first_window, first_window + count):
        owner.advance(w)
        started = time.perf_counter()
        owner.send(
            "w0",
            Plan(session_id=owner.session, sender="o0", window_id=w, counts_by_worker={"w0": 1}),
        )
        owner.wait_for((Kind.OPEN,), 60.0)
        out.append((time.perf_counter() - started) * 1e3)
    return out


def main() -> int:
    parser = bench_arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--bus", choices=["both", "embedded", "rabbitmq"], default="both")
    parser.add_argument("--url", default=DEFAULT_URL, help="broker URL for the rabbitmq bus")
    args = parser.parse_args()
    reps, per_rep, warmup = (5, 40, 20) if args.quick else (10, 200, 50)
    kinds = ["embedded", "rabbitmq"] if args.bus == "both" else [args.bus]
    session = f"bench{uuid.uuid4().hex[:8]}"
    num_windows = warmup + reps * per_rep
    report = BenchReport(bench="control")  # samples the host's load from here on

    server = EmbeddedBusServer()
    address = server.start()
    kwargs_by_kind: dict[str, dict[str, Any]] = {
        "embedded": {
            "host": address.host,
            "port": address.port,
            "authkey": address.authkey,
            "session": session,
        },
        "rabbitmq": {"url": args.url, "session": session},
    }
    owners: dict[str, ControlEndpoint] = {}
    notes: dict[str, str] = {}
    for kind in list(kinds):
        try:
            owners[kind] = ControlEndpoint(make_bus(kind, node_id="o0", **kwargs_by_kind[kind]))
        except PeerLostError as exc:
            notes[kind] = f"not measured: {exc}"
            kinds.remove(kind)
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(target=_worker, args=(k, kwargs_by_kind[k], num_windows), daemon=True)
        for k in kinds
    ]
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for p in workers:
            p.start()
        for kind in kinds:
            _round_trips_ms(owners[kind], 0, warmup)
        for rep in range(reps):  # alternate the buses, so noise hits both
            for kind in kinds:
                samples[kind] += _round_trips_ms(owners[kind], warmup + rep * per_rep, per_rep)
        for p in workers:
            p.join(timeout=30)
    finally:
        for p in workers:
            if p.is_alive():
                p.kill()
        for ep in owners.values():
            ep.bus.cleanup(["w0"])
            ep.close()
        server.close()

    report.config = {
        "quick": args.quick,
        "round_trips_per_bus": reps * per_rep,
        "warmup": warmup,
        "layout": "owner + embedded host in the bench process, worker in its own process",
        "url": args.url.split("@")[-1],
        **({"notes": notes} if notes else {}),
    }
    for kind in kinds:
        med, p99 = median(samples[kind]), percentile(samples[kind], 99)
        report.add_result(
            bus=kind, n=len(samples[kind]), plan_open_median_ms=med, plan_open_p99_ms=p99
        )
        report.add_target(f"{kind}_plan_open_median_ms", med, GOALS_MS[kind], "<=")
    if len(kinds) == 2:
        report.add_ratio(
            "rabbitmq_over_embedded_median",
            median(samples["rabbitmq"]) / median(samples["embedded"]),
        )
    report.write(args.out)
    return report.exit_code(require_quiet=args.require_quiet)


if __name__ == "__main__":
    leave(tool_exit("bench_control", main))
