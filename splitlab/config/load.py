"""Compose conf/ with Hydra, convert it once to `Config`, and save or load a run's resolved config.

This module and `splitlab.cli` are the only ones that import hydra or omegaconf. A launcher
saves the resolved config in the run folder once (`save_resolved_config`); every process of
the run reads it back with `load_resolved_config` (`python -m splitlab.node --config ...`).
Tools and tests compose with `compose_config(overrides)`.

    .venv/bin/pytest tests/config -q
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from splitlab.config.schema import GROUP_SCHEMAS, Config
from splitlab.config.validate import validate_config
from splitlab.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def register_configs() -> None:
    """Store the root schema and every group schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, options in GROUP_SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=f"schema/{group}", name=name, node=node)


def closest_first(word: str, known: Iterable[str]) -> list[str]:
    """`known` with the close matches to `word` first (closest leading), the rest in order."""
    known = list(known)
    close = difflib.get_close_matches(word, known, n=len(known), cutoff=0.6)
    return close + [k for k in known if k not in close]


def unknown_key_line(full_key: str, known: Iterable[str]) -> str:
    """One line for a key no schema declares: the key, its group, the group's known keys."""
    group, _, key = full_key.rpartition(".")
    where = group or "the top level"
    return (f"{full_key}: {where} has no key {key!r}; known keys of {where}, closest first: "
            f"{', '.join(closest_first(key, known))}")  # fmt: skip


def check_known_keys(node: DictConfig, prefix: str = "", *, ignore: Iterable[str] = ()) -> None:
    """Refuse a key that the node's dataclass schema does not declare. Hydra's own hint for a
    typo, `+transport.prot=1`, appends one, and `OmegaConf.to_object` would then set it as a
    stray attribute that nothing reads: the typo would run silently.

    Raises:
        ConfigError: names the key and the known keys of its group.
    """
    schema = OmegaConf.get_type(node)
    fields = (
        [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    )
    for key in node.keys():
        if key in ignore:  # e.g. the `hydra` node a callback sees beside the job's config
            continue
        full_key = f"{prefix}{key}"
        if fields is not None and key not in fields:
            raise ConfigError(unknown_key_line(full_key, fields))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            check_known_keys(child, f"{full_key}.")


def to_config(dcfg: DictConfig) -> Config:
    """Convert a composed DictConfig to dataclasses, naming the key when a value is missing or
    no schema declares it."""
    check_known_keys(dcfg)
    try:
        cfg = OmegaConf.to_object(dcfg)
    except Exception as exc:  # omegaconf raises several types; all carry the key path
        raise ConfigError(f"invalid config: {exc}") from exc
    assert isinstance(cfg, Config)
    return cfg


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """Compose conf/ with `overrides` outside a Hydra run and convert it, unchecked.

    The checks run one layer up, in `splitlab.configure.compose_config` (what tools and tests
    call): a local model folder's facts first, then values and registered names.
    """
    register_configs()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            dcfg = hydra.compose(config_name="config", overrides=list(overrides))
        except HydraException as exc:  # an override it cannot parse or merge: say which
            cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
            raise ConfigError(
                f"cannot compose the config from {list(overrides)}: {exc}{cause}"
            ) from exc
    return to_config(dcfg)


def save_resolved_config(cfg: Config, path: Path) -> None:
    """Write `cfg` as the YAML every process of the run starts from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), path)


def load_resolved_config(path: str | Path) -> Config:
    """Read a run folder's saved resolved config into the typed dataclasses, validated.

    Raises:
        ConfigError: the file is missing, a key or value does not fit the schema, or a group's
            `name` is not one of its options.
    """
    if not Path(path).is_file():
        raise ConfigError(f"--config={path}: no such file (the run's resolved config.yaml)")
    register_configs()
    raw = OmegaConf.load(path)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
    except Exception as exc:  # a wrong type or unknown key, with its path
        raise ConfigError(f"{path}: {exc}") from exc
    # Group nodes typed Any keep plain dicts: re-merge each onto its option's schema.
    for group in ("task", "architecture", "planner"):
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
