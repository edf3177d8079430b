"""The one process entry for every role of every study: `python -m splitlab.node`.

    python -m splitlab.node --config RUN/config.yaml --role ROLE --rank I [host facts]

ROLE is `coordinator`, `owner` or `worker` (fine-tuning, U-shape or two-stage: owners run the
first stage, workers the last), `evaluator` (a fine-tuning run's final evaluation, after
training; --out names its JSON) or `stage` (the inference ring; rank 0 is the head). The run's
resolved config (`RUN/config.yaml`, saved once by the launcher or by
`splitlab ... --cfg job > config.yaml`) is the only config carrier: every setting every process
must agree on is read from it. The command line adds only what differs per host:

    --run-dir DIR          traces (and the coordinator's checkpoints, the head's result) go here;
                           default: the config file's folder
    --session NAME         the run's name, the same on every process (default: splitlab)
    --device DEV           cpu, cuda or cuda:N (default: the config's `device`)
    --bind ADDR            listen address (training: transport.bind_host; stage: its
                           architecture.peer_hosts entry)
    --advertise ADDR       training: the data-plane address peers dial
    --port PORT            training: the data listener's port (stages use base_port + rank)
    --compute-weight W     worker: its WRR weight (default: architecture.compute_weights)
    --control HOST:PORT    the embedded control bus (control=embedded)
    --host-control         coordinator: host that bus here until every node has left
    --broker URL           RabbitMQ for control (and the data plane with transport=rabbitmq)

The secret is `$SPLITLAB_SESSION_KEY` (hex, the same on every host), or, as the `splitlab`
launcher hands them, this node's own `$SPLITLAB_NODE_KEY` and `$SPLITLAB_DATA_KEY`
(`splitlab.wire.session_key`), and under control.node_users its broker login
`$SPLITLAB_BROKER_LOGIN` (`splitlab.wire.broker_login`); no secret appears on a command line. Flags under "testing
only" (fixed microbatches, fault injection, the echo model, version skew) exist for tests and
check tools; runs never need them.
README.md ("Across hosts" and the ring's by-hand block) shows full examples, and
tests/integration/test_node_cli.py runs the fine-tuning one as written.

    .venv/bin/pytest tests/unit/test_node_args.py tests/integration/test_node_cli.py -q
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from splitlab.config.schema import Config
from splitlab.control.embedded import EmbeddedBusServer
from splitlab.errors import ConfigError, ExitCode, SplitlabError
from splitlab.launch.supervisor import die_with_launcher
from splitlab.telemetry.log import exit_now, setup_logging
from splitlab.train.role import EVALUATOR
from splitlab.wire.broker_login import apply_login
from splitlab.wire.session_key import session_key

log = logging.getLogger("splitlab.node")
ROLES = ("coordinator", "owner", "worker", "stage", EVALUATOR)
LEAVE_POLL_S = 0.05


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m splitlab.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", required=True, help="the run's resolved config (RUN/config.yaml)")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--rank", type=int, default=0, help="index among its role (stage index)")
    p.add_argument("--run-dir", help="traces, checkpoints, results (default: the config's folder)")
    p.add_argument("--session", default="splitlab", help="the run's name; the same everywhere")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's)")
    p.add_argument("--bind", help="listen address (default: the config's)")
    p.add_argument("--advertise", help="training: data-plane address peers dial")
    p.add_argument("--port", type=int, help="training: data listener port (default: config's)")
    p.add_argument("--compute-weight", type=float, help="worker: its WRR weight")
    p.add_argument("--control", help="HOST:PORT of the embedded control bus (control=embedded)")
    p.add_argument("--host-control", action="store_true",
                   help="coordinator: host the embedded bus at --control until all have left")  # fmt: skip
    p.add_argument("--broker", help="AMQP URL (control, and data with transport=rabbitmq)")
    test = p.add_argument_group("testing only")
    test.add_argument("--no-coordinator", action="store_true",
                      help="owner/worker: one round, no FedAvg; data key from the session key")  # fmt: skip
    test.add_argument("--batches", type=Path, help="owner: fixed microbatches (safetensors)")
    test.add_argument("--val-batches", type=Path, help="owner: fixed held-out microbatches")
    test.add_argument("--out", type=Path,
                      help="member: final partition state; coordinator: FedAvg history JSON; "
                           "evaluator: its result JSON (default RUN/final_metrics.json)")  # fmt: skip
    test.add_argument("--windows", type=int, help="windows this process runs per round")
    test.add_argument("--echo", action="store_true", help="stage: the model-free echo model")
    test.add_argument(
        "--ctrl-fault", choices=["nack", "hang", "slow_kv"], help="stage: barrier fault"
    )
    test.add_argument("--parity-override", action="append", default=[],
                      help="stage: FIELD=VALUE in this stage's reported versions")  # fmt: skip
    test.add_argument("--scripted-shifts",
                      help="head: TOKEN:BOUNDARY:K,... shifts instead of the config's planner")  # fmt: skip
    return p.parse_args(argv)


def control_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """`--control HOST:PORT` (None without it).

    Raises:
        ConfigError: a malformed address, or `--host-control` off the coordinator or without
            `--control`.
    """
    if args.host_control and (args.role != "coordinator" or not args.control):
        raise ConfigError("--host-control is for the coordinator, with --control HOST:PORT")
    if not args.control:
        return None
    host, sep, port = args.control.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--control={args.control!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def apply_host_facts(cfg: Config, args: argparse.Namespace) -> None:
    """This host's overrides of the shared config (device, addresses, broker)."""
    if args.device:
        cfg.device = args.device
    if args.broker:
        cfg.control.name = "rabbitmq"
        cfg.control.url = cfg.transport.url = args.broker
    elif args.control:
        cfg.control.name = "embedded"
    if args.role == "stage":
        return  # a stage's bind address is its own argument; ports come from base_port
    if args.bind:
        cfg.transport.bind_host = args.bind
    if args.advertise:
        cfg.transport.advertise_host = args.advertise
    if args.port is not None:
        cfg.transport.port = args.port


def parity_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--parity-override={item!r}: expected FIELD=VALUE")
        out[name] = value
    return out


def scripted_shifts(text: str | None) -> list[tuple[int, int, int]]:
    """`--scripted-shifts 4:1:1,6:1:-1` as (token, boundary, k) triples."""
    shifts = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        try:
            token, boundary, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise ConfigError(
                f"--scripted-shifts item {item!r}: expected TOKEN:BOUNDARY:K"
            ) from None
        shifts.append((token, boundary, k))
    return shifts


def run_stage_role(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    from splitlab.infer.stage import run_stage, stage_run

    run = stage_run(
        cfg, args.rank, session=args.session, run_dir=run_dir, bind=args.bind, echo=args.echo,
        ctrl_fault=args.ctrl_fault, parity_override=parity_overrides(args.parity_override),
        scripted_shifts=scripted_shifts(args.scripted_shifts),
    )  # fmt: skip
    return run_stage(run)


def run_train(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    from splitlab.train.role import Fixture, train_role
    from splitlab.train.roles import run_train_role

    address = control_address(args)
    fixture = Fixture(
        batches_path=args.batches, val_batches_path=args.val_batches, out_path=args.out,
        num_windows=args.windows, no_coordinator=args.no_coordinator,
    )  # fmt: skip
    role = train_role(
        cfg, args.role, args.rank, session=args.session, run_dir=run_dir,
        control_address=address, compute_weight=args.compute_weight, fixture=fixture,
    )  # fmt: skip
    (run_dir / "traces").mkdir(parents=True, exist_ok=True)
    server = host_bus(address) if args.host_control and address is not None else None
    log.info("%s starting (session %s, device %s)", role.name, role.session, role.device)
    try:
        run_train_role(role)
    finally:
        if server is not None:
            wait_until_left(server, role.timeout_s)
            server.close()
    return 0


def run_evaluator(cfg: Config, args: argparse.Namespace, run_dir: Path) -> int:
    """The run's final evaluation (`splitlab.train.final_eval`): its last merged checkpoint
    on held-out examples, written as JSON to --out (default RUN/final_metrics.json); nothing
    when there is no checkpoint. The launcher starts it after training, so that it never
    imports torch itself."""
    import json

    from splitlab.analysis.result import FINAL_METRICS_FILE
    from splitlab.train.final_eval import evaluate_checkpoint
    from splitlab.train.role import checkpoint_dir

    final = evaluate_checkpoint(cfg, checkpoint_dir(cfg, run_dir))
    if final is not None:
        (args.out or run_dir / FINAL_METRICS_FILE).write_text(json.dumps(final, indent=1))
    return 0


def host_bus(address: tuple[str, int]) -> EmbeddedBusServer:
    """The embedded control bus, in this process, with the session key.

    Raises:
        ConfigError: the address is taken or not this host's.
    """
    server = EmbeddedBusServer(*address, authkey=session_key())
    try:
        server.start()
    except OSError as exc:
        where = f"{address[0]}:{address[1]}"
        raise ConfigError(f"--control={where}: cannot host the control bus: {exc}") from exc
    return server


def wait_until_left(server: EmbeddedBusServer, timeout_s: float) -> None:
    """Keep the bus up until every node has read its STOP (or ABORT) and disconnected."""
    deadline = time.monotonic() + timeout_s
    while server.clients() and time.monotonic() < deadline:
        time.sleep(LEAVE_POLL_S)
    if server.clients():
        log.warning("%d nodes still on the control bus after %.0f s", server.clients(), timeout_s)


def main(argv: list[str] | None = None) -> int:
    die_with_launcher()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.role, args.rank)
    try:
        from splitlab.configure import load_resolved_config

        cfg = load_resolved_config(args.config)
        apply_host_facts(cfg, args)
        apply_login(cfg)  # this node's own broker user (control.node_users)
        run_dir = Path(args.run_dir) if args.run_dir else Path(args.config).resolve().parent
        if args.role == "stage":
            code = run_stage_role(cfg, args, run_dir)
        elif args.role == EVALUATOR:
            code = run_evaluator(cfg, args, run_dir)
        else:
            code = run_train(cfg, args, run_dir)
    except SplitlabError as exc:
        log.error("%s %d failed: %s: %s", args.role, args.rank, type(exc).__name__, exc)
        return int(exc.exit_code)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("%s %d failed", args.role, args.rank)
        return int(ExitCode.ERROR)
    log.info("%s %d done", args.role, args.rank)
    return code


if __name__ == "__main__":
    exit_now(main())
