"""One fine-tuning node process: from the launcher's JSON spec, or started by hand on any host.

Local runs (`splitlab`) start every node as `python -m splitlab.launch.node --spec RUN/nodes/X.json`.
Across hosts, copy the run's resolved config (RUN/config.yaml or RUN/.hydra/config.yaml) to
every host and start each process by hand with the same session name and broker:

    python -m splitlab.launch.node --role coordinator --config config.yaml \\
        --broker amqp://user:pw@10.0.0.1:5672/%2F --session exp1 --run-dir runs/exp1
    python -m splitlab.launch.node --role worker --rank 0 --config config.yaml \\
        --broker amqp://user:pw@10.0.0.1:5672/%2F --session exp1 --device cuda \\
        --compute-weight 3 --bind 0.0.0.0 --advertise 10.0.0.7 --port 29500
    python -m splitlab.launch.node --role owner --rank 0 --config config.yaml \\
        --broker amqp://user:pw@10.0.0.1:5672/%2F --session exp1 --device cpu

`--broker` sets both the control bus and (with `transport=rabbitmq` in the config) the
tensor transport to that broker. The data-plane key travels in START from the coordinator, so
no secret is passed on a command line or in the environment.

    .venv/bin/pytest tests/integration/test_finetune_task.py -q
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from splitlab.errors import ExitCode, SplitlabError
from splitlab.telemetry.log import setup_logging
from splitlab.train.process import NodeSpec, run_node

log = logging.getLogger("splitlab.launch.node")


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


def spec_from_args(args: argparse.Namespace) -> NodeSpec:
    """The node spec a by-hand start describes (config + role + this host's overrides)."""
    from splitlab.cli import load_resolved_config  # reads the saved config into dataclasses
    from splitlab.launch.train import node_spec

    if not args.role or not args.config:
        raise SystemExit("--role and --config are required without --spec")
    cfg = load_resolved_config(args.config)
    if args.device:
        cfg.device = args.device
    if args.broker:
        cfg.control.url = cfg.transport.url = args.broker
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.spec:
        spec = NodeSpec.from_json(Path(args.spec).read_text())
    else:
        try:
            spec = spec_from_args(args)
        except SplitlabError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return int(exc.exit_code)
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
    log.info("%s %s done", spec.role, spec.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
