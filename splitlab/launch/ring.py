"""The `task=infer` runner: the ring's config saved once, one node command per stage.

`prepare_ring` resolves what the config leaves open (cuts, loopback addresses, a free base
port), saves a random-init model once into the run folder so every stage loads the same
weights (copied from the cache after the first build: `splitlab.models.random_checkpoint`),
and writes `RUN/config.yaml`; `stage_children` starts every stage as
`python -m splitlab.node --config RUN/config.yaml --role stage --rank I` with the session key
in its environment; `run_infer` runs them under `splitlab.launch.supervisor.run_group` and
prints the prompt, the answer, TTFT, TPOT and tokens/s, and hands those figures to the selected
loggers (`splitlab.loggers`).

With a testbed (`testbed=ring3_edge`, as root) `run_ring` brings it up for the run (and down on
success, failure, SIGINT and SIGTERM), every stage runs inside the host `testbed.placement.stage`
names, with that host's CPU quota and thread count, and every address the stages use (the ring
and the control star) is their host's address on the testbed network; `RUN/testbed.json`
holds the testbed's nominal and probed link figures. A replayed drift profile is applied to
the kernel there (`splitlab.drift.kernel`): the launcher cuts the drifting stage's CPU quota
and link rate as the head reaches each change's token (RUN/drift/kernel.jsonl), and the stages
inject no sleep.

    splitlab task=infer                                  # 3-stage SmolLM2 ring on loopback
    splitlab task=infer model=tiny_llama architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]
    splitlab task=infer planner=forced_shift planner.at_token=40 task.max_new_tokens=80
    splitlab task=infer planner=adaptive drift=one_slow_node
    splitlab task=infer testbed=ring3_edge                   # as root: 3 half-core hosts
    splitlab task=infer testbed=ring3_edge planner=adaptive drift=cpu_throttle drift.phi=4
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from splitlab.config.enums import ModelSource
from splitlab.config.load import save_resolved_config
from splitlab.config.schema import Config, ModelConfig, RingConfig
from splitlab.control.membership import new_session_key_hex
from splitlab.drift.kernel import kernel_drift
from splitlab.errors import ConfigError, ExitCode
from splitlab.infer.folders import RANDOM_CHECKPOINT, RESULT_FILE, model_folder
from splitlab.infer.topology import resolve_ring
from splitlab.launch.supervisor import LAUNCHER_PID_ENV, ChildSpec, GroupResult, run_group
from splitlab.launch.threads import local_stage_env
from splitlab.launch.zygote import ForkedNode, Zygotes
from splitlab.models.random_checkpoint import save_random_checkpoint
from splitlab.preflight import preflight
from splitlab.testbed.netns import TestbedError
from splitlab.testbed.placement import (
    fetch_node_assets,
    node_argv,
    place,
    testbed_for,
    write_record,
)
from splitlab.testbed.session import Testbed
from splitlab.wire.session_key import SESSION_KEY_ENV

log = logging.getLogger(__name__)
CONFIG_FILE = "config.yaml"
STAGE_ROLE = "stage"  # the placement's role name for ring stages


def ports_free(hosts: Sequence[str], base_port: int) -> bool:
    for i, host in enumerate(hosts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, base_port + i))
            except OSError:
                return False
    return True


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT, HIGHEST_PORT = 20000, 60000


def base_port_range(count: int, ephemeral: tuple[int, int] | None) -> tuple[int, int]:
    """Where a base port for `count` consecutive listening ports is drawn from (inclusive):
    below the kernel's `ephemeral` range when there is room. Outgoing connections take their
    local ports from that range, so a port picked inside it could be taken between the pick
    and the stage's bind (seen in CI: four rings launched at once through Slurm, one stage
    failing on `Address already in use`)."""
    if ephemeral is not None and ephemeral[0] - count >= LOWEST_PORT + 1000:
        return LOWEST_PORT, ephemeral[0] - count
    return LOWEST_PORT, HIGHEST_PORT - count


def _ephemeral_ports() -> tuple[int, int] | None:
    try:
        low, high = (int(v) for v in EPHEMERAL_PORTS.read_text().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def random_base_port(count: int) -> int:
    return random.randint(*base_port_range(count, _ephemeral_ports()))


def pick_base_port(hosts: Sequence[str], *, tries: int = 50) -> int:
    """A base port whose `len(hosts)` consecutive ports are free on their hosts."""
    for _ in range(tries):
        base = random_base_port(len(hosts))
        if ports_free(hosts, base):
            return base
    raise ConfigError(f"no free set of {len(hosts)} ports found on {list(hosts)}")


def model_ref(model: ModelConfig, run_dir: Path, *, seed: int) -> str:
    """A model folder every stage can read (a random-init model is saved there first)."""
    if ModelSource(model.source) is ModelSource.random:
        save_random_checkpoint(model, run_dir / RANDOM_CHECKPOINT, seed=seed)
    return str(model_folder(model, run_dir))


def prepare_ring(cfg: Config, run_dir: Path, *, echo: bool = False,
                 testbed: Testbed | None = None) -> Path:  # fmt: skip
    """Resolve the ring, pick free ports, save the model (random init; not for the echo model
    of checks and tests) and `RUN/config.yaml`; on a `testbed`, stage i's address is its
    host's and the testbed's record goes to `RUN/testbed.json`.

    Raises:
        ConfigError: a bad ring (see `resolve_ring`), a configured base port in use, or
            addresses set by hand on a testbed run.
    """
    if testbed is None and cfg.testbed.hosts:
        raise ConfigError(
            f"testbed={cfg.testbed.name}: the ring's testbed is not up (start it with run_ring)"
        )
    ring = resolve_ring(cfg) if testbed is None else ring_on_testbed(cfg, testbed)
    fetch_node_assets(cfg)
    if testbed is not None:
        # fresh namespaces: nothing else listens there, and the root namespace cannot bind
        # their addresses to check
        base_port = ring.base_port or random_base_port(len(ring.peer_hosts))
    else:
        base_port = ring.base_port or pick_base_port(ring.peer_hosts)
        if not ports_free(ring.peer_hosts, base_port):
            raise ConfigError(
                f"architecture.base_port={base_port}: a port of {ring.peer_hosts} is in use "
                "(stale stage?)"
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    if not echo:
        model_ref(cfg.model, run_dir, seed=cfg.task.seed)
    if testbed is not None:
        write_record(testbed, run_dir)
    resolved = dataclasses.replace(cfg, architecture=dataclasses.replace(ring, base_port=base_port))
    path = run_dir / CONFIG_FILE
    save_resolved_config(resolved, path)
    return path


def ring_on_testbed(cfg: Config, testbed: Testbed) -> RingConfig:
    """The resolved ring with every stage's address (and the head's, for the control star) on
    its testbed host.

    Raises:
        ConfigError: `architecture.peer_hosts` or `ctrl_host` set by hand (the placement decides).
    """
    ring = resolve_ring(cfg)
    if cfg.architecture.peer_hosts or cfg.architecture.ctrl_host:
        raise ConfigError(
            f"architecture.peer_hosts={list(cfg.architecture.peer_hosts)} / "
            f"architecture.ctrl_host={cfg.architecture.ctrl_host!r} with testbed={cfg.testbed.name}: "
            "the testbed places the stages (testbed.placement.stage); leave both unset"
        )
    hosts = [place(testbed, STAGE_ROLE, i).address for i in range(ring.stages)]
    return dataclasses.replace(ring, peer_hosts=hosts, ctrl_host=hosts[0])


def stage_argv(config_path: Path, stage: int, *, run_dir: Path, session: str) -> list[str]:
    """The one node command for stage `stage` of the ring saved at `config_path`."""
    return [
        sys.executable, "-m", "splitlab.node", "--config", str(config_path), "--role", "stage",
        "--rank", str(stage), "--run-dir", str(run_dir), "--session", session,
    ]  # fmt: skip


def stage_children(
    config_path: Path,
    num_stages: int,
    *,
    run_dir: Path,
    session: str,
    key_hex: str,
    stage_args: Mapping[int, Sequence[str]] | None = None,
    echo: bool = False,
    testbed: Testbed | None = None,
) -> list[ChildSpec]:
    """One `ChildSpec` per stage, tail first (the head starts generating last); `stage_args`
    adds test-only node flags per stage, `echo` runs the model-free echo model everywhere; on a
    `testbed` each runs inside its placement's host. Each gets `local_stage_env`: its share of this
    host's cores."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # on a testbed its host's own count wins (`Testbed.command`)
    env = local_stage_env(num_stages)

    def placed(i: int, argv: list[str]) -> list[str]:
        return argv if testbed is None else node_argv(testbed, STAGE_ROLE, i, argv)

    return [
        ChildSpec(
            name=f"stage-{i}",
            argv=placed(
                i,
                [
                    *stage_argv(config_path, i, run_dir=run_dir, session=session),
                    *(["--echo"] if echo else []),
                    *(stage_args or {}).get(i, ()),
                ],
            ),
            env={SESSION_KEY_ENV: key_hex, **env},
            log_path=logs / f"stage-{i}.log",
        )  # fmt: skip
        for i in reversed(range(num_stages))
    ]


def ring_children(cfg: Config, run_dir: Path, *,
                  stage_args: Mapping[int, Sequence[str]] | None = None,
                  echo: bool = False, testbed: Testbed | None = None) -> list[ChildSpec]:  # fmt: skip
    """`prepare_ring`, then every stage's child with a fresh session name and key."""
    config_path = prepare_ring(cfg, run_dir, echo=echo, testbed=testbed)
    return stage_children(
        config_path, len(resolve_ring(cfg).cuts) + 1, run_dir=run_dir,
        session=f"{run_dir.name}-{secrets.token_hex(4)}", key_hex=new_session_key_hex(),
        stage_args=stage_args, echo=echo, testbed=testbed,
    )  # fmt: skip


def run_ring(cfg: Config, *, run_dir: str | Path, timeout_s: float | None = None,
             stage_args: Mapping[int, Sequence[str]] | None = None, echo: bool = False,
             testbed: Testbed | None = None) -> tuple[GroupResult, dict | None]:  # fmt: skip
    """Start every stage, wait; returns the group result and the head's result JSON (if any).

    A config with a testbed runs on `testbed` when given (a bench reuses one across runs),
    else on one brought up and down around this run.
    """
    run_dir = Path(run_dir)
    if testbed is None and cfg.testbed.hosts:
        with testbed_for(cfg.testbed) as tb:
            return run_ring(cfg, run_dir=run_dir, timeout_s=timeout_s, stage_args=stage_args,
                            echo=echo, testbed=tb)  # fmt: skip
    children = ring_children(cfg, run_dir, stage_args=stage_args, echo=echo, testbed=testbed)
    applier = kernel_drift(cfg.drift, testbed, run_dir, num_stages=len(children))
    with applier or contextlib.nullcontext():
        group = run_group(children, timeout_s=timeout_s)
    if applier is not None and applier.error is not None:
        raise TestbedError(f"drift={cfg.drift.name}: a kernel change failed: {applier.error}")
    result_path = run_dir / RESULT_FILE
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    return group, result


def run_infer(cfg: Config, *, preflighted: bool = False) -> int:
    """The `task=infer` runner: a local ring on the composed config; prints `answer_lines`.
    `preflighted`: the caller (`cli.run`) already ran `preflight(cfg)`."""
    if not preflighted:
        preflight(cfg)
    run_dir = Path(cfg.run_dir or f"outputs/infer-{time.strftime('%Y%m%d-%H%M%S')}")
    group, result = run_ring(cfg, run_dir=run_dir)
    if group.exit_code != 0:
        log.error("ring failed: %s", group.diagnosis())
        return group.exit_code
    if result is None:
        log.error("the head exited 0 but wrote no result")
        return int(ExitCode.ERROR)
    print(answer_lines(result), flush=True)
    from splitlab.loggers.write import log_run  # only once the ring is done

    log_run(cfg, run_dir, ring=result)
    log.info("traces in %s", run_dir / "traces")
    return 0


def answer_lines(result: Mapping[str, Any]) -> str:
    """What `task=infer` prints: the prompt, the answer once, TTFT, TPOT and tokens/s."""
    return "\n".join([
        f"prompt: {result['prompt']}",
        f"answer: {result['text'] or result['token_ids']}",
        f"{len(result['token_ids'])} tokens ({result['stop_reason']}): "
        f"TTFT {result['ttft_ms']:.1f} ms, TPOT median {result['tpot_ms_median']:.2f} ms, "
        f"{result['tokens_per_s']:.1f} tokens/s",
    ])  # fmt: skip


def spawn_stages(cfg: Config, *, run_dir: str | Path,
                 stage_args: Mapping[int, Sequence[str]] | None = None, echo: bool = False,
                 ) -> list[subprocess.Popen]:  # fmt: skip
    """Start every stage as a bare subprocess (no supervisor: each must fail on its own).

    Checks and fault-injection tools use this to see how each stage exits by itself; `run_ring`
    is the launcher path. Output goes to RUN/logs/stage-<i>.log; returns the processes in
    stage order (Popen, or `ForkedNode` where the stages fork from a zygote as under
    `run_ring`: each dies with it, and it with this process).
    """
    children = ring_children(cfg, Path(run_dir), stage_args=stage_args, echo=echo)
    zygotes = Zygotes([c.argv for c in children], pid_env=LAUNCHER_PID_ENV)
    procs: list[subprocess.Popen[bytes] | ForkedNode] = []
    try:
        for child in reversed(children):  # stage order
            assert child.log_path is not None
            env = {**os.environ, **child.env, "PYTHONUNBUFFERED": "1"}
            with open(child.log_path, "w", encoding="utf-8") as out:
                procs.append(zygotes.spawn(child.argv, env, out.fileno()) or subprocess.Popen(
                    list(child.argv), stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=env,
                ))  # fmt: skip
    finally:
        zygotes.release()
    return procs
