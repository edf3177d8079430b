"""A run's config, composed or loaded and fully checked: schema, cross-field values, registries.

`splitlab.config.load` composes conf/ with Hydra and reads a saved resolved config; the
config package checks what it knows (types, ranges, cross-field rules) and imports no other
subpackage. The registered names (model families, transports, control buses, planners, drift
profiles) live with their packages, so their check (`splitlab.choices.check_registered`) runs
here, one layer above all of them. Before both, a model config naming a local folder takes
that folder's facts (layers, width, tied head: `splitlab.models.folder`), so the cross-field
checks see the real model. Tools, tests and `python -m splitlab.node` call these.

    .venv/bin/pytest tests/config tests/unit/test_registries.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from splitlab.choices import check_registered
from splitlab.config import load
from splitlab.config.schema import Config
from splitlab.config.validate import validate_config
from splitlab.models.folder import resolve_local_model


def validate(cfg: Config) -> None:
    """Every config check before any process starts: a local model folder's facts written into
    `cfg.model` (in place), then cross-field values, then registered names."""
    cfg.model = resolve_local_model(cfg.model)
    validate_config(cfg)
    check_registered(cfg)


def compose_config(overrides: Sequence[str] = ()) -> Config:
    """Compose conf/ with `overrides` outside a Hydra run (tests, tools), fully checked."""
    cfg = load.compose_config(overrides)
    validate(cfg)
    return cfg


def load_resolved_config(path: str | Path) -> Config:
    """A run folder's saved resolved config (every node starts from it), fully checked."""
    cfg = load.load_resolved_config(path)
    check_registered(cfg)
    return cfg
