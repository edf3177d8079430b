"""The family registry: an explicit dict from family name to adapter.

A new family is one `FamilyAdapter` subclass and one `register_family(name, adapter)` call;
no scheduler changes. The built-in families register themselves when
`splitlab.models.families` is imported.

    .venv/bin/pytest tests/unit/test_models_registry.py
"""

from __future__ import annotations

from torch import nn

from splitlab.errors import ConfigError
from splitlab.models.families.base import FamilyAdapter

_FAMILIES: dict[str, FamilyAdapter] = {}


def register_family(name: str, adapter: FamilyAdapter, *, replace: bool = False) -> None:
    """Make `adapter` available as `model.family=name`.

    Raises:
        ValueError: `name` is taken and `replace` is False (a programming error, not config).
    """
    if name in _FAMILIES and not replace:
        raise ValueError(f"model family {name!r} is already registered")
    _FAMILIES[name] = adapter


def unregister_family(name: str) -> None:
    """Remove `name` from the registry (tests and plugins that registered it temporarily)."""
    _FAMILIES.pop(name, None)


def get_family(name: str) -> FamilyAdapter:
    """The adapter registered as `name` (accepts the `Family` enum too).

    Raises:
        ConfigError: naming `model.family` and the known names.
    """
    key = getattr(name, "value", name)
    try:
        return _FAMILIES[key]
    except KeyError:
        raise ConfigError(
            f"model.family={key!r}: unknown family (registered: {sorted(_FAMILIES)})"
        ) from None


def families() -> dict[str, FamilyAdapter]:
    """A copy of the registry."""
    return dict(_FAMILIES)


def family_for_model(model: nn.Module) -> FamilyAdapter:
    """The registered adapter that accepts `model.config.model_type`.

    Raises:
        ConfigError: no registered family handles this model type.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for adapter in _FAMILIES.values():
        if model_type in adapter.model_types:
            return adapter
    raise ConfigError(
        f"model_type={model_type!r}: no registered family handles it "
        f"(registered: {sorted(_FAMILIES)})"
    )
