"""One fine-tuning node process: from the launcher's JSON spec, or started by hand on any host.

Local runs (`splitlab`) start every node as `python -m splitlab.launch.node --spec RUN/nodes/X.json`.
Across hosts, copy the run's resolved config (RUN/config.yaml) to every host and start each
process by hand with the same session name and control plane: `--control HOST:PORT` for the
embedded bus, which the coordinator hosts (`--host-control`; every process reads its secret
from $SPLITLAB_CONTROL_AUTHKEY), or `--broker URL` for RabbitMQ (control=rabbitmq):

    export SPLITLAB_CONTROL_AUTHKEY=...   # the same 64 hex digits on every host
    python -m splitlab.launch.node --role coordinator --config config.yaml \\
        --control 10.0.0.1:29400 --host-control --session exp1 --run-dir runs/exp1
    python -m splitlab.launch.node --role worker --rank 0 --config config.yaml \\
        --control 10.0.0.1:29400 --session exp1 --device cuda --compute-weight 3 \\
        --bind 0.0.0.0 --advertise 10.0.0.7 --port 29500 --run-dir runs/exp1
    python -m splitlab.launch.node --role owner --rank 0 --config config.yaml \\
        --control 10.0.0.1:29400 --session exp1 --device cpu --run-dir runs/exp1

`--broker` sets the control bus to RabbitMQ at that URL and (with `transport=rabbitmq` in the
config) the tensor transport too. The data-plane key travels in START from the coordinator,
so no data-plane secret is passed on a command line or in the environment. README.md ("Across
hosts") has the same example; tests/integration/test_node_cli.py runs exactly it on loopback.

    .venv/bin/pytest tests/integration/test_node_cli.py -q
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from splitlab.config.enums import ControlName
from splitlab.control.embedded import ENV_AUTHKEY, ENV_HOST, ENV_PORT, EmbeddedBusServer
from splitlab.errors import ConfigError, ExitCode, SplitlabError
from splitlab.telemetry.log import setup_logging
from splitlab.train.process import NodeSpec, run_node

log = logging.getLogger("splitlab.launch.node")
LEAVE_POLL_S = 0.05


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m splitlab.launch.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--spec", help="a launcher's JSON node spec (overrides everything else)")
    p.add_argument("--role", choices=["coordinator", "owner", "worker"])
    p.add_argument("--rank", type=int, default=0, help="index among its role (owner i, worker j)")
    p.add_argument("--config", help="the run's resolved config (RUN/config.yaml)")
    p.add_argument(
        "--broker", help="AMQP URL of the RabbitMQ broker (control, and data if rabbitmq)"
    )
    p.add_argument("--control", help="HOST:PORT of the embedded control bus (control=embedded)")
    p.add_argument(
        "--host-control", action="store_true",
        help="coordinator: host the embedded bus at --control until every node has left",
    )  # fmt: skip
    p.add_argument("--session", default="splitlab", help="the run's name; the same on every host")
    p.add_argument(
        "--run-dir", default=".", help="traces (and the coordinator's checkpoints) go here"
    )
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's)")
    p.add_argument("--compute-weight", type=float, help="worker: its WRR weight (default: config)")
    p.add_argument("--bind", help="data-plane listen address (default: the config's)")
    p.add_argument("--advertise", help="data-plane address peers dial (default: bind/route)")
    p.add_argument("--port", type=int, help="data-plane listen port (default: the config's)")
    return p.parse_args(argv)


def control_address(args: argparse.Namespace) -> tuple[str, int] | None:
    """`--control HOST:PORT` (None without it).

    Raises:
        ConfigError: a malformed address, `--host-control` off the coordinator or without
            `--control`, or no $SPLITLAB_CONTROL_AUTHKEY to authenticate with.
    """
    if args.host_control and (args.role != "coordinator" or not args.control):
        raise ConfigError("--host-control is for the coordinator, with --control HOST:PORT")
    if not args.control:
        return None
    host, sep, port = args.control.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--control={args.control!r}: expected HOST:PORT")
    if not os.environ.get(ENV_AUTHKEY):
        raise ConfigError(f"--control needs ${ENV_AUTHKEY} (the bus secret, hex; same everywhere)")
    return host.strip("[]"), int(port)


def spec_from_args(args: argparse.Namespace) -> NodeSpec:
    """The node spec a by-hand start describes (config + role + this host's overrides)."""
    from splitlab.cli import load_resolved_config  # reads the saved config into dataclasses
    from splitlab.launch.train import node_spec

    if not args.role or not args.config:
        raise ConfigError("--role and --config are required without --spec")
    cfg = load_resolved_config(args.config)
    if args.device:
        cfg.device = args.device
    if args.broker:
        cfg.control.name = ControlName.rabbitmq
        cfg.control.url = cfg.transport.url = args.broker
    elif args.control:
        cfg.control.name = ControlName.embedded
    if args.bind:
        cfg.transport.bind_host = args.bind
    if args.advertise:
        cfg.transport.advertise_host = args.advertise
    if args.port is not None:
        cfg.transport.port = args.port
    return node_spec(
        cfg, args.role, args.rank, session=args.session, run_dir=Path(args.run_dir),
        compute_weight=args.compute_weight,
    )  # fmt: skip


def host_bus(address: tuple[str, int]) -> EmbeddedBusServer:
    """The embedded control bus, in this process, with the environment's secret."""
    server = EmbeddedBusServer(*address, authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
    server.start()
    return server


def wait_until_left(server: EmbeddedBusServer, timeout_s: float) -> None:
    """Keep the bus up until every node has read its STOP (or ABORT) and disconnected."""
    deadline = time.monotonic() + timeout_s
    while server.clients() and time.monotonic() < deadline:
        time.sleep(LEAVE_POLL_S)
    if server.clients():
        log.warning("%d nodes still on the control bus after %.0f s", server.clients(), timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    server = None
    if args.spec:
        spec = NodeSpec.from_json(Path(args.spec).read_text())
    else:
        try:
            address = control_address(args)
            spec = spec_from_args(args)
            if address is not None:
                os.environ[ENV_HOST], os.environ[ENV_PORT] = address[0], str(address[1])
            if args.host_control and address is not None:
                server = host_bus(address)
        except SplitlabError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return int(exc.exit_code)
        except OSError as exc:  # the bus address is taken or not ours
            print(f"error: cannot host the control bus at {args.control}: {exc}", file=sys.stderr)
            return int(ExitCode.ERROR)
        if spec.trace_dir:
            Path(spec.trace_dir).mkdir(parents=True, exist_ok=True)
        if spec.checkpoint_dir:
            Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    setup_logging(spec.role, spec.rank)
    log.info("%s %s starting (session %s, device %s)", spec.role, spec.name, spec.session,
             spec.device)  # fmt: skip
    try:
        run_node(spec)
    except SplitlabError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return int(exc.exit_code)
    except Exception:
        log.exception("failed")
        return int(ExitCode.ERROR)
    finally:
        if server is not None:
            wait_until_left(server, spec.timeout_s)
            server.close()
    log.info("%s %s done", spec.role, spec.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
