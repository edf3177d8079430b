"""Fine-tuning topology -> node specs, and the `task=finetune` runner (the main job).

`node_specs` turns the composed config into one `NodeSpec` per process (a coordinator, the
owners, the workers); `run_finetune` saves the resolved config in the run folder, hosts the
embedded control bus (or uses RabbitMQ), starts every node as `python -m splitlab.launch.node
--spec ...` under `splitlab.launch.supervisor.run_group` (first failure wins, logs streamed,
children torn down), then writes metrics.csv and the loss/accuracy plot from the owners'
`round` trace records and prints where everything is.

Both architectures run: `u_shape` (front/body/tail) and `two_stage` (first/last stage), with
or without the low-rank cut of `finetune.sft` (`checkpoint_model` says what its checkpoints
hold).

    splitlab                                            # MiniLM, Rotten Tomatoes, 2 owners x 1 worker
    splitlab control=rabbitmq transport=rabbitmq        # the same over the broker
    splitlab task.resume=true hydra.run.dir=<run folder> # continue after its last checkpoint
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from splitlab.config.enums import ControlName, FinetuneMethod
from splitlab.config.schema import Config, FinetuneTaskConfig, TwoStageConfig, UShapeConfig
from splitlab.errors import ConfigError, ExitCode
from splitlab.launch.ring import plain
from splitlab.launch.supervisor import ChildSpec, run_group
from splitlab.train.feed import microbatches_per_round
from splitlab.train.process import NodeSpec

log = logging.getLogger(__name__)
COORDINATOR = "coordinator"
METRIC_COLUMNS = (
    "round",
    "owner",
    "loss",
    "accuracy",
    "perplexity",
    "train_loss",
    "samples",
    "bytes",
)


def owner_names(num: int) -> list[str]:
    return [f"owner{i}" for i in range(num)]


def worker_names(num: int) -> list[str]:
    return [f"worker{i}" for i in range(num)]


def checkpoint_dir(cfg: Config, run_dir: Path) -> Path:
    task = cfg.task
    return Path(task.checkpoint_dir) if task.checkpoint_dir else run_dir / "checkpoints"


def _check(cfg: Config) -> tuple[FinetuneTaskConfig, UShapeConfig | TwoStageConfig]:
    task, arch = cfg.task, cfg.architecture
    if not isinstance(task, FinetuneTaskConfig):
        raise ConfigError(f"task={task.name}: run_finetune needs task=finetune")
    if not isinstance(arch, UShapeConfig | TwoStageConfig):
        raise ConfigError(
            f"architecture={arch.name}: task=finetune across processes runs u_shape or two_stage"
        )
    if (
        isinstance(arch, UShapeConfig)
        and arch.compute_weights
        and (len(arch.compute_weights) != arch.workers)
    ):
        raise ConfigError(
            f"architecture.compute_weights={arch.compute_weights}: {arch.workers} workers"
        )
    return task, arch


def node_spec(
    cfg: Config,
    role: str,
    rank: int,
    *,
    session: str,
    run_dir: Path,
    compute_weight: float | None = None,
) -> NodeSpec:
    """The spec of one node (`role` coordinator|owner|worker, `rank` among its role)."""
    task, arch = _check(cfg)
    owners, workers = owner_names(arch.owners), worker_names(arch.workers)
    per_round = microbatches_per_round(
        samples_per_owner=cfg.data.samples_per_owner,
        batch_size=cfg.finetune.batch_size,
        steps_per_round=task.steps_per_round,
    )
    two_stage = isinstance(arch, TwoStageConfig)
    quota = arch.control_count if two_stage else arch.microbatches_per_window
    names = {COORDINATOR: [COORDINATOR], "owner": owners, "worker": workers}
    if role not in names or not 0 <= rank < len(names[role]):
        raise ConfigError(
            f"role={role!r} rank={rank}: {arch.owners} owners, {arch.workers} workers"
        )
    weights = ([] if two_stage else list(arch.compute_weights)) or [1.0] * arch.workers
    lora = plain(cfg.finetune.lora) if cfg.finetune.method is FinetuneMethod.lora else None
    windows = max(1, math.ceil(per_round / quota))
    timeout_s = arch.timeout_s
    if role == COORDINATOR:  # it waits a whole round (all windows + validation) for UPDATEs
        timeout_s = arch.timeout_s * (windows + 2)
    shape: dict[str, Any] = {"architecture": arch.name.value, "control_count": quota}
    if isinstance(arch, UShapeConfig):
        shape.update(
            tail_blocks=arch.tail_blocks, max_inflight=arch.max_inflight,
            worker_max_inflight=arch.worker_max_inflight, adaptive_weights=arch.adaptive_weights,
            objective=arch.objective.value,
        )  # fmt: skip
    return NodeSpec(
        role=role, name=names[role][rank], rank=rank, session=session, owners=owners,
        workers=workers, model=plain(cfg.model) or {}, out_path="", num_windows=windows,
        quota=quota, seed=task.seed, cut_layers=arch.cut_layers,
        lr=cfg.finetune.lr, weight_decay=cfg.finetune.weight_decay, clip_grad_norm=cfg.finetune.clip_grad_norm, timeout_s=timeout_s,
        coordinator=COORDINATOR, rounds=task.rounds, resume=task.resume,
        checkpoint_dir=str(checkpoint_dir(cfg, run_dir)) if task.save_checkpoint else None,
        trace_dir=str(run_dir / "traces"), lora=lora,
        merge_for_fedavg=cfg.finetune.merge_for_fedavg, device=cfg.device,
        control=plain(cfg.control), transport=plain(cfg.transport),
        data=plain(cfg.data) if role == "owner" else None, batch_size=cfg.finetune.batch_size,
        steps_per_round=task.steps_per_round, validate=task.validate,
        compute_weight=compute_weight if compute_weight is not None else (
            weights[rank] if role == "worker" else 1.0
        ),
        progress=task.progress, sft=plain(cfg.finetune.sft) if cfg.finetune.sft.enabled else None,
        **shape,
    )  # fmt: skip


def node_specs(cfg: Config, *, session: str, run_dir: Path) -> list[NodeSpec]:
    """Every node: the coordinator, then the workers, then the owners."""
    _, arch = _check(cfg)
    roles = [(COORDINATOR, 1), ("worker", arch.workers), ("owner", arch.owners)]
    return [
        node_spec(cfg, role, rank, session=session, run_dir=run_dir)
        for role, count in roles
        for rank in range(count)
    ]


def child_specs(specs: list[NodeSpec], run_dir: Path, env: dict[str, str]) -> list[ChildSpec]:
    """One child per node spec, its JSON in RUN/nodes/, its log in RUN/logs/."""
    (run_dir / "nodes").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    children = []
    for spec in specs:
        path = run_dir / "nodes" / f"{spec.name}.json"
        path.write_text(json.dumps(dataclasses.asdict(spec), indent=1))
        argv = [sys.executable, "-m", "splitlab.launch.node", "--spec", str(path)]
        children.append(
            ChildSpec(
                name=spec.name, argv=argv, env=env, log_path=run_dir / "logs" / f"{spec.name}.log"
            )
        )
    return children


def save_resolved_config(cfg: Config, path: Path) -> None:
    """The config every node of this run starts from (`splitlab.cli.load_resolved_config`)."""
    from omegaconf import OmegaConf  # the launcher writes what the CLI reads back

    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), path)


def round_records(trace_dir: Path) -> list[dict[str, Any]]:
    """The owners' `round` records of a run, in (round, owner) order."""
    rows = []
    for path in sorted(trace_dir.glob("owner-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if record.get("kind") == "round":
                    rows.append(record)
    return sorted(rows, key=lambda r: (r["round"], str(r["owner"])))


def write_metrics(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRIC_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in METRIC_COLUMNS})


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    import pandas as pd

    from splitlab.analysis.plots import plot_training_rounds

    frame = pd.DataFrame(rows)
    if "accuracy" not in frame or frame["accuracy"].isna().all():
        frame["accuracy"] = float("nan")  # causal LMs: loss only
    plot_training_rounds(frame).savefig(path, dpi=110)


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    """Per round: sample-weighted held-out loss and accuracy over the owners."""
    lines = []
    for round_id in sorted({r["round"] for r in rows}):
        got = [r for r in rows if r["round"] == round_id]
        total = sum(r.get("samples") or 0 for r in got) or 1
        parts = [f"round {round_id}"]
        for name in ("loss", "accuracy", "perplexity"):
            values = [(r[name], r.get("samples") or 0) for r in got if r.get(name) is not None]
            if values:
                parts.append(f"{name} {sum(v * w for v, w in values) / total:.4f}")
        lines.append(", ".join(parts))
    return lines


def checkpoint_model(cfg: Config) -> tuple[Any, Any]:
    """(model, tokenizer) with the architecture a checkpoint of this config holds: the loaded
    model, with the FFNs at `finetune.sft`'s low-rank cuts decomposed (a checkpoint of an SFT
    run keeps the trained factors, `...lowrank_in.weight` / `...lowrank_out.*`, not a product
    folded back), so `model.load_state_dict(checkpoint.state, strict=True)` works."""
    import torch

    from splitlab.models.load import load_model
    from splitlab.models.lowrank import decompose_plan
    from splitlab.sft.parts import sft_plan

    torch.manual_seed(cfg.task.seed)
    model, tokenizer = load_model(cfg.model)
    if cfg.finetune.sft.enabled:
        decompose_plan(model, sft_plan(partition_plan(cfg), cfg.finetune.sft))
    return model, tokenizer


def partition_plan(cfg: Config) -> Any:
    from splitlab.models.plan import two_stage_plan, u_shape_plan

    arch, layers = cfg.architecture, cfg.model.num_layers
    if isinstance(arch, TwoStageConfig):
        return two_stage_plan(num_layers=layers, cut_layers=arch.cut_layers)
    return u_shape_plan(num_layers=layers, cut_layers=arch.cut_layers, tail_blocks=arch.tail_blocks)


def evaluate_checkpoint(cfg: Config, run_dir: Path) -> dict[str, Any] | None:
    """The last merged checkpoint, unsplit, in this process, on `data.test_samples` examples
    nobody trained or validated on (or, when that is 0, on the per-round held-out split)."""
    from splitlab.data.owners import build_owner_datasets, build_test_shard
    from splitlab.models.parts import build_parts
    from splitlab.train.checkpoint import latest_checkpoint
    from splitlab.train.validate import evaluate, part_chain

    checkpoint = latest_checkpoint(checkpoint_dir(cfg, run_dir))
    if checkpoint is None:
        return None
    model, tokenizer = checkpoint_model(cfg)
    model.load_state_dict(checkpoint.state, strict=True)
    parts = build_parts(model, partition_plan(cfg))  # the decomposed FFNs run inside their blocks
    held = build_test_shard(cfg.data, tokenizer, num_owners=cfg.architecture.owners)
    if held is None:
        _, held = build_owner_datasets(
            cfg.data, tokenizer, num_owners=cfg.architecture.owners, round_index=checkpoint.round_id
        )
    batches = held.batches(cfg.finetune.batch_size, seed=0)
    metrics = evaluate(part_chain(parts), parts[-1].adapter, batches)
    return {"round": checkpoint.round_id, "split": held.name, "samples": len(held),
            **metrics.to_dict()}  # fmt: skip


def thread_env(num_nodes: int) -> dict[str, str]:
    """OpenMP settings for `num_nodes` training processes sharing this host's cores.

    Each node gets cpu_count // num_nodes intra-op threads (at least 1) and idle threads sleep
    (`stage_env`). With the defaults every node spins a thread per core: on 2 cores the 1x1
    bench burned 7-9x the CPU per sample under load (tools/bench_ushape.py `cpu_ms_per_sample`).
    A user's own OMP_NUM_THREADS / OMP_WAIT_POLICY win.
    """
    from splitlab.launch.ring import stage_env

    threads = max(1, (os.cpu_count() or 1) // max(1, num_nodes))
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)), **stage_env()}


def run_finetune(cfg: Config) -> int:
    """The `task=finetune` runner: every node as a local process; returns the exit code."""
    _check(cfg)
    began = time.monotonic()
    run_dir = Path(cfg.run_dir or f"outputs/finetune-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved_config(cfg, run_dir / "config.yaml")
    session = f"ft-{secrets.token_hex(5)}"
    specs = node_specs(cfg, session=session, run_dir=run_dir)
    server = None
    # transformers' load reports and progress bars would drown the nodes' progress lines
    env: dict[str, str] = {
        "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
        **thread_env(len(specs) - 1),  # the coordinator only averages
    }  # fmt: skip
    if ControlName(cfg.control.name) is ControlName.embedded:
        from splitlab.control.embedded import EmbeddedBusServer

        server = EmbeddedBusServer()
        env.update(server.start().to_env())
    log.info(
        "run folder %s: %d owners x %d workers, %s data plane, %s control, session %s",
        run_dir, len(specs[0].owners), len(specs[0].workers), cfg.transport.name.value,
        cfg.control.name.value, session,
    )  # fmt: skip
    try:
        group = run_group(child_specs(specs, run_dir, env))
    finally:
        if server is not None:
            server.close()
    rows = round_records(run_dir / "traces")
    if rows:
        write_metrics(rows, run_dir / "metrics.csv")
        write_plot(rows, run_dir / "training_rounds.png")
    if group.exit_code != 0:
        log.error("fine-tuning failed: %s", group.diagnosis())
        return group.exit_code
    if not rows:
        log.error("every node exited 0 but no owner traced a round")
        return int(ExitCode.ERROR)
    for line in summarize(rows):
        log.info("owners before FedAvg, %s", line)
    if cfg.task.validate and cfg.task.save_checkpoint:
        final = evaluate_checkpoint(cfg, run_dir)
        if final is not None:
            (run_dir / "final_metrics.json").write_text(json.dumps(final, indent=1))
            log.info(
                "merged model after round %d on the %s split (%d examples): loss %.4f, accuracy %s",
                final["round"], final["split"], final["samples"], final["val_loss"],
                final["val_accuracy"],
            )  # fmt: skip
    where = checkpoint_dir(cfg, run_dir)
    log.info(
        "done in %.1f s: config %s, metrics %s, plot %s, traces %s, checkpoints %s",
        time.monotonic() - began, run_dir / "config.yaml", run_dir / "metrics.csv",
        run_dir / "training_rounds.png", run_dir / "traces", where,
    )  # fmt: skip
    return 0
