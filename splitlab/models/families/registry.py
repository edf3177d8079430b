"""The family registry: an explicit dict from family name to what the family is and its adapter.

A new family is one `FamilyAdapter` subclass and one `register_family(name, adapter)` call;
no scheduler changes. The built-in families register themselves when
`splitlab.models.families` is imported, by "module:Class" with their task and model types:
config validation reads those (`family_kind`) without importing torch or transformers, and
the adapter's module is imported on the first `get_family`.

    .venv/bin/pytest tests/unit/test_models_registry.py
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING

from splitlab.config.enums import TaskKind
from splitlab.errors import ConfigError, registered

if TYPE_CHECKING:
    from torch import nn

    from splitlab.models.families.base import FamilyAdapter


@dataclass(frozen=True, kw_only=True)
class FamilyKind:
    """One registered family as config validation sees it; `target` is built on first use."""

    name: str  # registry key, `model.family`
    task: TaskKind  # what the model's head computes
    model_types: frozenset[str]  # accepted `config.model_type` values
    target: FamilyAdapter | str  # the adapter, or "package.module:Class" (imported lazily)
    ties_head: bool = False  # a random-init model's head is its embedding (preflight reads it)


_FAMILIES: dict[str, FamilyKind] = {}
_ADAPTERS: dict[str, FamilyAdapter] = {}  # adapters built so far, by name


def register_family(
    name: str,
    adapter: FamilyAdapter | str,
    *,
    task: TaskKind | None = None,
    model_types: Iterable[str] = (),
    ties_head: bool = False,
    replace: bool = False,
) -> None:
    """Make `adapter` available as `model.family=name`.

    Args:
        adapter: an adapter instance, or "package.module:Class" of one, imported and built on
            the first `get_family` (then `task`, `model_types` and `ties_head` are taken from
            here and checked against the class).

    Raises:
        ValueError: `name` is taken and `replace` is False, or a lazy registration lacks its
            task or model types (programming errors, not config).
    """
    if name in _FAMILIES and not replace:
        raise ValueError(f"model family {name!r} is already registered")
    if isinstance(adapter, str):
        if task is None or not model_types:
            raise ValueError(f"model family {name!r} by path needs its task and model_types")
        kind = FamilyKind(name=name, task=task, model_types=frozenset(model_types),
                          target=adapter, ties_head=ties_head)  # fmt: skip
    else:
        kind = FamilyKind(
            name=name, task=adapter.task, model_types=frozenset(adapter.model_types),
            target=adapter, ties_head=adapter.ties_head,
        )  # fmt: skip
    _ADAPTERS.pop(name, None)
    _FAMILIES[name] = kind


def unregister_family(name: str) -> None:
    """Remove `name` from the registry (tests and plugins that registered it temporarily)."""
    _FAMILIES.pop(name, None)
    _ADAPTERS.pop(name, None)


def family_kind(name: str) -> FamilyKind:
    """The registered family `name` (task, model types) without building its adapter.

    Raises:
        ConfigError: naming `model.family` and the known names.
    """
    return registered(_FAMILIES, name, "model.family")


def _build(kind: FamilyKind) -> FamilyAdapter:
    if not isinstance(kind.target, str):
        return kind.target
    module, _, cls = kind.target.partition(":")
    adapter = getattr(import_module(module), cls)()
    if (adapter.task is not kind.task or frozenset(adapter.model_types) != kind.model_types
            or adapter.ties_head != kind.ties_head):  # fmt: skip
        raise ValueError(
            f"model family {kind.name!r} was registered with task={kind.task.value}, "
            f"model_types={sorted(kind.model_types)}, ties_head={kind.ties_head}; {kind.target} "
            f"has task={adapter.task.value}, model_types={sorted(adapter.model_types)}, "
            f"ties_head={adapter.ties_head}"
        )
    return adapter


def get_family(name: str) -> FamilyAdapter:
    """The adapter registered as `name` (its module is imported on the first call).

    Raises:
        ConfigError: naming `model.family` and the known names.
    """
    kind = family_kind(name)
    if name not in _ADAPTERS:
        _ADAPTERS[name] = _build(kind)
    return _ADAPTERS[name]


def families() -> dict[str, FamilyAdapter]:
    """Every registered adapter by name (builds those not built yet)."""
    return {name: get_family(name) for name in _FAMILIES}


def family_for_model_type(model_type: str | None, *, where: str = "model_type") -> FamilyAdapter:
    """The registered adapter that accepts `model_type` (a transformers config's).

    Raises:
        ConfigError: no registered family handles this model type.
    """
    for kind in _FAMILIES.values():
        if model_type in kind.model_types:
            return get_family(kind.name)
    raise ConfigError(
        f"{where}: model_type={model_type!r}: no registered family handles it "
        f"(registered: {sorted(_FAMILIES)})"
    )


def family_for_model(model: nn.Module) -> FamilyAdapter:
    """The registered adapter that accepts `model.config.model_type`.

    Raises:
        ConfigError: no registered family handles this model type.
    """
    return family_for_model_type(getattr(getattr(model, "config", None), "model_type", None))
