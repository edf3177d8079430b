"""Config names checked against the registries, and what each registered option supports.

The open sets of choices are registries, not enums: model families (`register_family`),
transports (`register_transport`), control buses (`register_bus`), planners
(`register_planner`) and drift profiles (`register_profile`). `check_registered` runs after
`splitlab.config.validate.validate_config`, before any process starts: an unknown name is a
ConfigError listing the registered ones, and a transport or bus that a task does not run is
refused naming the key and the task. It sits above every subpackage so that config imports
none of them.

    splitlab task=infer transport=rabbitmq          # refused (exit 2): the ring runs over TCP
    .venv/bin/pytest tests/unit/test_registries.py tests/config -q
"""

from __future__ import annotations

from splitlab.config.enums import TaskKind
from splitlab.config.schema import Config, FinetuneTaskConfig
from splitlab.control.bus import bus_kind, buses
from splitlab.drift.source import drift_names
from splitlab.errors import ConfigError
from splitlab.infer.planners import make_planner, planner_schema
from splitlab.models.families import family_kind
from splitlab.wire.registry import transport_kind, transports


def _runs(group: str, name: str, task: str, tasks: frozenset[str], usable: list[str]) -> None:
    if task not in tasks:
        raise ConfigError(
            f"{group}={name} is not run by task={task} ({group}.name={name} serves "
            f"{sorted(tasks)}; task={task} runs {group} in {sorted(usable)})"
        )


def check_groups(cfg: Config) -> None:
    """The transport and control options the task runs; the planner and drift names."""
    task = cfg.task.name.value
    name = cfg.transport.name
    usable = [n for n, k in transports().items() if task in k.tasks]
    _runs("transport", name, task, transport_kind(name).tasks, usable)
    name = cfg.control.name
    usable = [n for n, k in buses().items() if task in k.tasks]
    _runs("control", name, task, bus_kind(name).tasks, usable)
    schema = planner_schema(cfg.planner.name)
    if not isinstance(cfg.planner, schema):
        raise ConfigError(
            f"planner.name={cfg.planner.name!r} takes {schema.__name__}, got "
            f"{type(cfg.planner).__name__}: pick the option with planner={cfg.planner.name}"
        )
    make_planner(cfg.planner)  # its values and files (a calibration) fail here, not mid-run
    if cfg.drift.name not in drift_names():
        raise ConfigError(f"drift.name={cfg.drift.name!r}: choose from {drift_names()}")


def check_family(cfg: Config) -> None:
    """The model family exists and its head fits the task and the data."""
    family = family_kind(cfg.model.family)
    task = cfg.task.name.value
    if isinstance(cfg.task, FinetuneTaskConfig):
        data = cfg.data
        classifies = family.task is TaskKind.classification
        if classifies and data.task is not TaskKind.classification:
            raise ConfigError(
                f"model={cfg.model.name} (model.family={family.name}) classifies sequences; "
                f"data={data.name} has data.task={data.task.value}"
            )
        if classifies and data.labels:
            if len(data.labels) != cfg.model.num_labels:
                raise ConfigError(
                    f"data.labels has {len(data.labels)} classes {list(data.labels)} but "
                    f"model.num_labels={cfg.model.num_labels}"
                )
    elif task in ("infer", "calibrate") and family.task is not TaskKind.causal_lm:
        raise ConfigError(
            f"task={task} generates text: model={cfg.model.name} is a {family.name.upper()} "
            f"{family.task.value} model (model.family={family.name}), not a causal LM"
        )


def check_registered(cfg: Config) -> None:
    """Refuse names no registry knows and options a task does not run (ConfigError, exit 2)."""
    check_groups(cfg)
    check_family(cfg)
