"""The `task=finetune` runner (the main job): one process per role, then metrics and plots.

`run_finetune` saves the resolved config in the run folder once, hosts the embedded control
bus (or uses RabbitMQ), starts every role with the one node command (`node_children`: a
coordinator, the workers, the owners, each `python -m splitlab.node --config RUN/config.yaml
--role ROLE --rank I ...`, the session key in their environment) under
`splitlab.launch.supervisor.run_group` (first failure wins, logs streamed, children torn
down), then has `splitlab.analysis.rounds` draw the loss/accuracy plot from the owners'
`round` trace records, evaluates the last merged checkpoint (`splitlab.train.final_eval`),
hands round and final metrics to the selected loggers (`splitlab.loggers`: metrics.csv by
default), writes RUN/analysis/report.html (`splitlab.analysis.report`, what `task=analyze`
writes) and prints where everything is.

Both architectures run: `u_shape` (front/body/tail) and `two_stage` (first/last stage), with
or without the low-rank cut of `finetune.sft` (`splitlab.train.final_eval.checkpoint_model`
says what its checkpoints hold).

With a `testbed` (as root) the run is wrapped in its testbed session: every role runs inside
its host with every address on the testbed network (`splitlab.testbed.placement`: the
coordinator then hosts the embedded bus in its host), TCP paths get their delay line, and
RUN/testbed.json records the hosts and the nominal and probed links.

    splitlab                                            # MiniLM, Rotten Tomatoes, 2 owners x 1 worker
    splitlab control=rabbitmq transport=rabbitmq        # the same over the broker
    splitlab testbed=edge_cloud_wan                     # owners on edge hosts, 20 Mbit/s (root)
    splitlab task.resume=true hydra.run.dir=<run folder> # continue after its last checkpoint
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from pathlib import Path

from splitlab.config.load import save_resolved_config
from splitlab.config.schema import Config, TwoStageConfig, UShapeConfig
from splitlab.control.bus import queue_name
from splitlab.control.membership import new_session_key_hex
from splitlab.errors import ExitCode, PeerLostError
from splitlab.launch.supervisor import LAUNCHER_PID_ENV, ChildSpec, run_group
from splitlab.launch.threads import role_threads, thread_env
from splitlab.launch.zygote import Zygotes
from splitlab.preflight import preflight
from splitlab.testbed.placement import (
    control_address,
    fetch_node_assets,
    node_argv,
    testbed_for,
    write_record,
)
from splitlab.testbed.session import Testbed
from splitlab.train.checkpoint_files import checkpoint_bytes
from splitlab.train.role import (
    COORDINATOR,
    EVALUATOR,
    check_finetune,
    checkpoint_dir,
    role_names,
)
from splitlab.wire.broker_login import LOGIN_ENV
from splitlab.wire.session_key import (
    DATA_KEY_ENV,
    NODE_KEY_ENV,
    SESSION_KEY_ENV,
    data_plane_key,
    node_key,
)

log = logging.getLogger(__name__)


def node_children(
    cfg: Config,
    config_path: Path,
    *,
    run_dir: Path,
    session: str,
    control: tuple[str, int] | None,
    env: dict[str, str],
    testbed: Testbed | None = None,
    logins: dict[str, str] | None = None,
) -> list[ChildSpec]:
    """One child per role (the coordinator, then the workers, then the owners), each started
    with the one node command and only its own secrets (`node_secrets`, and its broker login
    from `logins` under control.node_users); its log in
    RUN/logs/. On a `testbed` each runs inside its host
    (`splitlab.testbed.placement`), listening on the host's address; the coordinator hosts the
    embedded bus at `control`, and the broker is dialled through the testbed's relay."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    children = []
    names = role_names(cfg)
    threads = role_threads(owners=len(names["owner"]), workers=len(names["worker"]),
                           cores=os.cpu_count() or 1)  # fmt: skip
    for role in (COORDINATOR, "worker", "owner"):  # workers listen before owners dial
        for rank, name in enumerate(names[role]):
            argv = [
                sys.executable, "-m", "splitlab.node", "--config", str(config_path),
                "--role", role, "--rank", str(rank), "--run-dir", str(run_dir),
                "--session", session,
            ]  # fmt: skip
            if control is not None:
                argv += ["--control", f"{control[0]}:{control[1]}"]
            hosts_bus = False
            if testbed is not None:
                broker = cfg.control.url if cfg.control.name == "rabbitmq" else None
                argv = node_argv(testbed, role, rank, argv, broker=broker)
                hosts_bus = "--host-control" in argv
            secrets_env = node_secrets(env, session, name, hosts_bus=hosts_bus)
            if logins is not None:
                secrets_env[LOGIN_ENV] = logins[name]
            children.append(ChildSpec(name=name, argv=argv,
                                      env={**secrets_env, **thread_env(threads[role])},
                                      log_path=run_dir / "logs" / f"{name}.log"))  # fmt: skip
    return children


def node_secrets(
    env: dict[str, str], session: str, name: str, *, hosts_bus: bool
) -> dict[str, str]:
    """`env` as node `name` gets it: the session key in `env` is replaced by what the node's
    identity needs (`splitlab.wire.session_key`): its own bus credential `node_key(name)` and
    the data-plane key. Only the node hosting the embedded bus (the coordinator on a testbed)
    keeps the session key, from which it derives every node's credential. An `env` without
    the session key is returned as it is."""
    if SESSION_KEY_ENV not in env or hosts_bus:
        return dict(env)
    out = dict(env)
    key = bytes.fromhex(out.pop(SESSION_KEY_ENV))
    out[NODE_KEY_ENV] = node_key(name, key).hex()
    out[DATA_KEY_ENV] = data_plane_key(session, key).hex()
    return out


def create_node_users(cfg: Config, session: str, nodes: list[str]) -> dict[str, str] | None:
    """Under control.node_users, the session's vhost and one broker user per node
    (`splitlab.control.broker_users`); returns {node id: its login}, else None."""
    if not cfg.control.node_users:
        return None
    from splitlab.control import broker_users
    from splitlab.control.rabbitmq import control_queue_args  # pulls in pika

    began = time.monotonic()
    logins = broker_users.create(cfg.control.url, session, nodes, control_queue_args())
    log.info("broker vhost %s with %d node users, in %.1f s", broker_users.vhost(session),
             len(nodes), time.monotonic() - began)  # fmt: skip
    return logins


def remove_broker_queues(cfg: Config, session: str, nodes: list[str]) -> None:
    """Delete the queues the session's nodes declared on a RabbitMQ broker (control bus and
    tensor transport), once they have all exited: a node that died never deleted its own.
    A broker that cannot be reached now is said once; the queues then expire by themselves.
    Under control.node_users the session's vhost goes instead, its queues and users with it."""
    if cfg.control.node_users:
        from splitlab.control import broker_users

        for failure in broker_users.remove(session, nodes):
            log.warning("left on the broker (python tools/broker_users.py removes it): %s",
                        failure)  # fmt: skip
        return
    by_url: dict[str, list[str]] = {}
    if cfg.control.name == "rabbitmq":
        by_url.setdefault(cfg.control.url, []).extend(queue_name(session, n) for n in nodes)
    if cfg.transport.name == "rabbitmq":
        from splitlab.wire.amqp import session_queues

        by_url.setdefault(cfg.transport.url, []).extend(session_queues(session, nodes))
    if not by_url:
        return
    from splitlab.control.rabbitmq import delete_queues  # pulls in pika

    for url, names in by_url.items():
        try:
            deleted = delete_queues(url, names)
        except PeerLostError as exc:
            log.warning("the queues of session %s stay on the broker until they expire (1 h): "
                        "%s", session, exc)  # fmt: skip
        else:
            log.debug("deleted the %d queues of session %s", deleted, session)


# transformers' load reports and progress bars would drown the nodes' progress lines
QUIET_ENV = {
    "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
}  # fmt: skip

# What the steps after training import (pandas, matplotlib: ~1 s of one core; the final
# evaluation, which needs torch, is a child of its own): loaded while the nodes train
# (`WarmImports`) instead of before they start.
POST_RUN_MODULES = (
    "splitlab.analysis.rounds",
    "splitlab.analysis.report",
    "splitlab.loggers.write",
)


class WarmImports:
    """Import modules in a daemon thread once `start` is called: `run_finetune` starts it
    when every node is up (`run_group(when_up=...)`), so the nodes start without waiting for
    the launcher's own imports and the steps after training find them loaded. Niceness cannot
    keep the thread off the nodes' cores (every node has its own session, so its own
    scheduler autogroup); starting late does. `join` before importing any of them: a
    module that fails to import here is left alone, its real import raises where it is used.
    """

    def __init__(self, modules: tuple[str, ...] = POST_RUN_MODULES) -> None:
        self.modules = modules
        self.thread = threading.Thread(target=self._load, name="warm-imports", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        if self.thread.is_alive():
            self.thread.join()

    def _load(self) -> None:
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - raised again at its real import
                continue


def run_finetune(cfg: Config, *, preflighted: bool = False) -> int:
    """The `task=finetune` runner: every node as a local process; returns the exit code.
    `preflighted`: the caller (`cli.run`) already ran `preflight(cfg)`."""
    _, arch = check_finetune(cfg)
    if not preflighted:
        preflight(cfg)
    began = time.monotonic()
    run_dir = Path(cfg.run_dir or f"outputs/finetune-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    save_resolved_config(cfg, config_path)
    evaluation = final_eval_child(config_path, run_dir)
    # the nodes and the final evaluation fork from one zygote: this process never imports torch
    zygotes = Zygotes([evaluation.argv], pid_env=LAUNCHER_PID_ENV)
    try:
        return _finetune(cfg, arch, began, run_dir, config_path, evaluation, zygotes)
    finally:
        zygotes.close()


def final_eval_child(config_path: Path, run_dir: Path) -> ChildSpec:
    """The final evaluation as a child of the launcher: the node command's evaluator role,
    which writes RUN/final_metrics.json."""
    argv = [
        sys.executable, "-m", "splitlab.node", "--config", str(config_path), "--role", EVALUATOR,
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = {**QUIET_ENV, **thread_env(os.cpu_count() or 1)}  # the nodes' zygote's, but threads
    return ChildSpec(name="final-eval", argv=argv, env=env,
                     log_path=run_dir / "logs" / "final-eval.log")  # fmt: skip


def _finetune(
    cfg: Config, arch: UShapeConfig | TwoStageConfig, began: float, run_dir: Path,
    config_path: Path, evaluation: ChildSpec, zygotes: Zygotes,
) -> int:  # fmt: skip
    fetch_node_assets(cfg)
    session = f"ft-{secrets.token_hex(5)}"
    key_hex = new_session_key_hex()
    server, control = None, None
    env: dict[str, str] = {SESSION_KEY_ENV: key_hex, **QUIET_ENV}
    with testbed_for(cfg.testbed) as tb:
        if tb is not None:  # the coordinator hosts the bus inside its host
            write_record(tb, run_dir)
            control = control_address(tb) if cfg.control.name == "embedded" else None
        elif cfg.control.name == "embedded":
            from splitlab.control.embedded import EmbeddedBusServer

            server = EmbeddedBusServer(authkey=bytes.fromhex(key_hex))
            address = server.start()
            control = (address.host, address.port)
        log.info(
            "run folder %s: %d owners x %d workers, %s data plane, %s control, session %s%s",
            run_dir, arch.owners, arch.workers, cfg.transport.name, cfg.control.name, session,
            f", testbed {tb.topology.name} (session {tb.session})" if tb is not None else "",
        )  # fmt: skip
        warming = WarmImports()
        nodes = [name for names in role_names(cfg).values() for name in names]
        try:
            logins = create_node_users(cfg, session, nodes)
            children = node_children(
                cfg, config_path, run_dir=run_dir, session=session, control=control, env=env,
                testbed=tb, logins=logins,
            )  # fmt: skip
            group = run_group(children, when_up=warming.start, zygotes=zygotes)
        finally:
            if server is not None:
                server.close()
            remove_broker_queues(cfg, session, nodes)
    if group.exit_code != 0:  # said before the imports below (seconds when not yet warm)
        log.error("fine-tuning failed: %s", group.diagnosis())
    warming.join()
    from splitlab.analysis.report import analyze_run
    from splitlab.analysis.result import FINAL_METRICS_FILE
    from splitlab.analysis.rounds import summarize, write_round_outputs
    from splitlab.loggers.write import log_run

    rows = write_round_outputs(run_dir)  # the rounds done, failed run or not
    if group.exit_code != 0:
        return group.exit_code
    if not rows:
        log.error("every node exited 0 but no owner traced a round")
        return int(ExitCode.ERROR)
    for line in summarize(rows):
        log.info("owners before FedAvg, %s", line)
    final = None
    if cfg.task.validate and cfg.task.save_checkpoint:
        path = run_dir / FINAL_METRICS_FILE
        path.unlink(missing_ok=True)  # a resumed run's earlier result is not this one's
        evaluated = run_group([evaluation], zygotes=zygotes)
        if evaluated.exit_code != 0:
            log.error("the final evaluation failed: %s", evaluated.diagnosis())
            return evaluated.exit_code
        final = json.loads(path.read_text()) if path.is_file() else None
        if final is not None:
            final["wall_s"] = time.monotonic() - began  # the whole job, evaluation included
            (run_dir / FINAL_METRICS_FILE).write_text(json.dumps(final, indent=1))
            log.info(
                "merged model after round %d on the %s split (%d examples): loss %.4f, accuracy %s",
                final["round"], final["split"], final["samples"], final["val_loss"],
                final["val_accuracy"],
            )  # fmt: skip
    log_run(cfg, run_dir, rounds=rows, final=final)
    report = analyze_run(run_dir)
    where = checkpoint_dir(cfg, run_dir)
    num_files, num_bytes = checkpoint_bytes(where)  # torch-free: this process has none
    log.info(
        "done in %.1f s: report %s, config %s, plot %s, traces %s, checkpoints %s "
        "(%d files, %.1f MiB)",
        time.monotonic() - began, report.path, run_dir / "config.yaml",
        run_dir / "training_rounds.png",
        run_dir / "traces", where, num_files, num_bytes / 2**20,
    )  # fmt: skip
    return 0
