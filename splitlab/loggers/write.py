"""`log_run`: hand a finished run's metrics and resolved config to every selected logger.

Thin shells over `points`; each logger library is imported inside its writer, so a run that
does not select it never loads it (`registry.check_loggers` has already checked it is there).

    splitlab logger=[csv,tensorboard,mlflow] task.rounds=2
    tensorboard --logdir RUN/tensorboard
    mlflow ui --backend-store-uri sqlite:///RUN/mlflow/mlflow.db
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitlab.config.schema import (
    Config,
    CsvLoggerConfig,
    MlflowLoggerConfig,
    TensorboardLoggerConfig,
)
from splitlab.loggers.points import (
    MetricPoint,
    config_params,
    final_points,
    ring_points,
    round_points,
)
from splitlab.loggers.registry import selected

log = logging.getLogger(__name__)
CONFIG_FILE = "config.yaml"  # the resolved config the launcher saved in the run folder
MLFLOW_BATCH_METRICS = 1000  # MLflow's log_batch limits per call
MLFLOW_BATCH_PARAMS = 100


@dataclass(frozen=True)
class RunLog:
    """What every logger receives about one finished run."""

    run_dir: Path
    points: list[MetricPoint]
    params: dict[str, str]  # the resolved config, flattened
    config_text: str  # the resolved config as saved (YAML)
    rounds: list[dict[str, Any]]  # the owners' round records (the csv table)


def write_csv(options: CsvLoggerConfig, run: RunLog) -> str:
    if not run.rounds:  # a ring run: its figures are in RUN/ring_result.json
        return str(run.run_dir / "ring_result.json")
    from splitlab.analysis.rounds import write_metrics  # pandas: ~0.3 s a ring run skips

    path = run.run_dir / "metrics.csv"
    write_metrics(run.rounds, path)
    return str(path)


def write_tensorboard(options: TensorboardLoggerConfig, run: RunLog) -> str:
    from torch.utils.tensorboard import SummaryWriter

    folder = run.run_dir / options.dir
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for p in run.points:
            writer.add_scalar(p.name, p.value, p.step)
        # four leading spaces: TensorBoard renders text as Markdown, this keeps it a code block
        writer.add_text("config", "".join(f"    {line}\n" for line in run.config_text.splitlines()))
    finally:
        writer.close()
    return str(folder)


def mlflow_uri(options: MlflowLoggerConfig, run_dir: Path) -> str:
    if options.tracking_uri:
        return options.tracking_uri
    return f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}"


def write_mlflow(options: MlflowLoggerConfig, run: RunLog) -> str:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    # their store set-up chatter; warnings still show (mlflow sets its level on import)
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)

    uri = mlflow_uri(options, run.run_dir)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(options.experiment)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:  # artifacts beside a default store, else where the user's store puts them
        where = (run.run_dir / "mlflow" / "artifacts").resolve().as_uri()
        experiment_id = client.create_experiment(
            options.experiment, artifact_location=None if options.tracking_uri else where
        )
    mlrun = client.create_run(experiment_id, run_name=options.run_name or run.run_dir.name)
    run_id = mlrun.info.run_id
    now_ms = int(time.time() * 1000)
    metrics = [Metric(p.name, p.value, now_ms, p.step) for p in run.points]
    params = [Param(k, v) for k, v in run.params.items()]
    for i in range(0, len(metrics), MLFLOW_BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[i : i + MLFLOW_BATCH_METRICS])
    for i in range(0, len(params), MLFLOW_BATCH_PARAMS):
        client.log_batch(run_id, params=params[i : i + MLFLOW_BATCH_PARAMS])
    client.log_text(run_id, run.config_text, CONFIG_FILE)
    client.set_terminated(run_id)
    return f"{uri} (run {run_id})"


# option -> writer; returns where the user finds what it wrote
WRITERS: dict[str, Callable[[Any, RunLog], str]] = {
    "csv": write_csv,
    "tensorboard": write_tensorboard,
    "mlflow": write_mlflow,
}


def log_run(
    cfg: Config,
    run_dir: Path,
    *,
    rounds: Sequence[Mapping[str, Any]] = (),
    final: Mapping[str, Any] | None = None,
    ring: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Every selected logger writes the run's metrics and config; returns option -> where."""
    loggers = selected(cfg.logger)
    if not loggers:
        return {}
    config_path = run_dir / CONFIG_FILE
    run = RunLog(
        run_dir=run_dir,
        points=[*round_points(rounds), *final_points(final), *ring_points(ring)],
        params=config_params(cfg),
        config_text=config_path.read_text() if config_path.is_file() else "",
        rounds=[dict(r) for r in rounds],
    )
    where = {name: WRITERS[name](options, run) for name, options in loggers.items()}
    for name, place in where.items():
        log.info("logger %s: %s", name, place)
    return where
