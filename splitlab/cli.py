"""The `splitlab` entry point: compose conf/ with Hydra, convert once, validate, dispatch.

    splitlab                        # the main job (task=finetune on embedded defaults)
    splitlab --cfg job              # print the composed config
    splitlab task=infer             # a local 3-stage SmolLM2 ring
    splitlab -m finetune.sft.rank=1,8,32   # a Hydra multirun sweep

This is the only module that imports hydra; below it every function takes dataclasses.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from splitlab.config.schema import GROUP_SCHEMAS, Config
from splitlab.config.validate import validate_config
from splitlab.errors import ConfigError, ExitCode, SplitlabError
from splitlab.telemetry.log import setup_logging

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# task name -> "module:function" taking (cfg: Config) and returning an exit code.
TASKS: dict[str, str] = {
    "finetune": "splitlab.launch.train:run_finetune",
    "infer": "splitlab.launch.ring:run_infer",
    "calibrate": "splitlab.analysis.calibrate:run_calibrate",
    "analyze": "splitlab.analysis.report:run_analyze",
}

log = logging.getLogger("splitlab.cli")


def register_task(name: str, target: str) -> None:
    """Register the runner of `task=<name>` as "package.module:function" (imported lazily)."""
    TASKS[name] = target


def register_configs() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in GROUP_SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def to_config(dcfg: DictConfig) -> Config:
    """Convert a composed DictConfig to dataclasses, naming the key when a value is missing."""
    try:
        cfg = OmegaConf.to_object(dcfg)
    except Exception as exc:  # omegaconf raises several types; all carry the key path
        raise ConfigError(f"invalid config: {exc}") from exc
    assert isinstance(cfg, Config)
    return cfg


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """Compose conf/ with `overrides` outside a Hydra run (tests, tools), convert and validate."""
    register_configs()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = hydra.compose(config_name="config", overrides=list(overrides))
    cfg = to_config(dcfg)
    validate_config(cfg)
    return cfg


def load_resolved_config(path: str | Path) -> Config:
    """Read a run folder's saved resolved config (the launcher's nodes start from it)."""
    register_configs()
    raw = OmegaConf.load(path)
    merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    # Group nodes typed Any keep plain dicts: re-merge each onto its option's schema.
    for group in ("task", "architecture"):
        node = raw.get(group)
        if node is None:
            continue
        option = str(node.get("name"))
        schema = GROUP_SCHEMAS[group].get(option)
        if schema is None:
            raise ConfigError(
                f"{path}: {group}.name={option!r} is not one of {sorted(GROUP_SCHEMAS[group])}"
            )
        merged[group] = OmegaConf.merge(OmegaConf.structured(schema), node)
    cfg = to_config(merged)
    validate_config(cfg)
    return cfg


def resolve_task(name: str) -> Callable[[Config], int]:
    target = TASKS.get(name)
    if target is None:
        raise ConfigError(f"task={name} has no runner in this build (registered: {sorted(TASKS)})")
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def run(cfg: Config) -> int:
    """Validate and run one composed config; returns the process exit code."""
    validate_config(cfg)
    return int(resolve_task(cfg.task.name.value)(cfg))


register_configs()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dcfg: DictConfig) -> int:
    setup_logging("cli", 0)
    try:
        cfg = to_config(dcfg)
        cfg.run_dir = HydraConfig.get().runtime.output_dir
        code = run(cfg)
    except SplitlabError as exc:
        log.error("%s", exc)
        code = int(exc.exit_code)
    except KeyboardInterrupt:
        log.error("interrupted")
        code = 130
    if code != ExitCode.OK:
        # Hydra swallows return values; a non-zero exit must leave the process as one.
        sys.exit(code)
    return code


def main() -> None:
    """Console-script entry point (`splitlab`)."""
    _hydra_main()


if __name__ == "__main__":
    main()
