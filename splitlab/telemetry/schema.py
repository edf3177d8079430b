"""Trace record machinery: the `Record` base, the kind -> class registry and the field checks.

    .venv/bin/pytest tests/unit/test_telemetry_records.py -q

Pure. The record kinds themselves live in `splitlab.telemetry.records`, which registers them.
Every trace line is `{"ts_us", "role", "rank", "kind", ...fields}`: the tracer adds the first
three (`stamp`), a record class names the kind (`KIND`) and declares the fields with their
types. Writers build records (a misspelt field fails at construction); readers check the fields
they know by name and type (`check_record`) and let unknown fields and kinds through, so an
older reader keeps reading a newer writer's traces. A class may name one `SPREAD` field: a
`dict[str, ...]` whose items are written as top-level fields (counter snapshots, phase timings
whose names are data); a reader sees them as fields the class does not declare.

Type rules on reading (JSON's view of the declared type): `int` is an integer and never a bool;
`float` is any number, `null` (the tracer writes NaN as null) or "inf"/"-inf"; `str`, `bool`,
`list` and `dict` are themselves; `X | None` also takes null.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

BASE_FIELDS: tuple[str, ...] = ("ts_us", "role", "rank", "kind")
_BASE_TYPES: dict[str, type] = {"ts_us": int, "role": str, "rank": int, "kind": str}
_INFINITIES = ("inf", "-inf")


@dataclass(frozen=True, kw_only=True)
class Record:
    """One trace event of kind `KIND`; subclasses declare its fields (units in their names)."""

    KIND: ClassVar[str] = ""
    SPREAD: ClassVar[str] = ""  # a dict field written as top-level fields, if any

    def to_dict(self) -> dict[str, Any]:
        """`kind` and the fields, spread field flattened (values shared, not copied).

        An optional field left at its None default is omitted: absent and null read the same.
        A spread key never replaces a declared or base field.
        """
        out: dict[str, Any] = {"kind": self.KIND}
        omit_none = _none_defaults(type(self))
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if value is not None or name not in omit_none:
                out[name] = value
        if self.SPREAD:
            spread = out.pop(self.SPREAD)
            taken = _reserved(type(self))
            out.update((k, v) for k, v in spread.items() if k not in taken)
        return out


Emit = Callable[[Record], None]  # `Tracer.write`, or a test's recorder

RECORD_TYPES: dict[str, type[Record]] = {}


def register_record(cls: type[Record]) -> type[Record]:
    """Class decorator: `cls.KIND` -> `cls`; a kind is registered once, base names are reserved."""
    if not cls.KIND:
        raise TypeError(f"{cls.__name__} has no KIND")
    if cls.KIND in RECORD_TYPES and RECORD_TYPES[cls.KIND] is not cls:
        raise TypeError(f"record kind {cls.KIND!r} is already {RECORD_TYPES[cls.KIND].__name__}")
    clash = sorted(set(_field_names(cls)) & set(BASE_FIELDS))
    if clash:
        raise TypeError(f"{cls.__name__} declares {clash}: the tracer writes those itself")
    if cls.SPREAD and cls.SPREAD not in _field_names(cls):
        raise TypeError(f"{cls.__name__}.SPREAD names no field: {cls.SPREAD!r}")
    _field_types(cls)  # resolve (and fail on an unsupported annotation) once, at import
    RECORD_TYPES[cls.KIND] = cls
    return cls


def stamp(record: Record, *, ts_us: int, role: str, rank: int) -> dict[str, Any]:
    """The line a tracer writes: base fields first, then the record's."""
    return {"ts_us": ts_us, "role": role, "rank": rank, **record.to_dict()}


@cache
def _field_names(cls: type[Record]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@cache
def _reserved(cls: type[Record]) -> frozenset[str]:
    return frozenset((*BASE_FIELDS, *_field_names(cls)))


@cache
def _none_defaults(cls: type[Record]) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.default is None)


@dataclass(frozen=True)
class FieldType:
    """What JSON value a declared field accepts."""

    kinds: tuple[type, ...]
    nullable: bool

    @property
    def name(self) -> str:
        names = "|".join(k.__name__ for k in self.kinds)
        return f"{names}|None" if self.nullable else names

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable or float in self.kinds
        if isinstance(value, bool):
            return bool in self.kinds
        if float in self.kinds and (isinstance(value, (int, float)) or value in _INFINITIES):
            return True
        return isinstance(value, self.kinds)


def _field_type(annotation: Any, where: str) -> FieldType:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    kinds = tuple(typing.get_origin(a) or a for a in args if a is not type(None))
    if not kinds or not all(k in (int, float, str, bool, list, dict) for k in kinds):
        raise TypeError(f"{where}: unsupported trace field type {annotation!r}")
    return FieldType(kinds, nullable=len(kinds) < len(args))


@cache
def _field_types(cls: type[Record]) -> dict[str, FieldType]:
    hints = typing.get_type_hints(cls)
    return {
        name: _field_type(hints[name], f"{cls.__name__}.{name}")
        for name in _field_names(cls)
        if name != cls.SPREAD
    }


def field_types(kind: str) -> dict[str, FieldType]:
    """Declared fields of a registered kind and what each accepts; {} for an unknown kind."""
    cls = RECORD_TYPES.get(kind)
    return dict(_field_types(cls)) if cls is not None else {}


def required_fields(kind: str) -> tuple[str, ...]:
    """Fields every record of `kind` carries with a value: no default and not nullable."""
    cls = RECORD_TYPES.get(kind)
    if cls is None:
        return ()
    types_ = _field_types(cls)
    return tuple(
        f.name for f in dataclasses.fields(cls)
        if f.name in types_ and not types_[f.name].nullable
        and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )  # fmt: skip


def check_record(data: dict[str, Any]) -> list[str]:
    """Problems with the base fields and the known fields of one decoded line, by name.

    Unknown fields, and every field of an unknown kind, are not problems.
    """
    problems = [
        f"field {name!r} is {type(data[name]).__name__} {data[name]!r}, expected {kind.__name__}"
        for name, kind in _BASE_TYPES.items()
        if name in data and not FieldType((kind,), nullable=False).accepts(data[name])
    ]
    if problems:
        return problems
    for name, declared in field_types(data["kind"]).items():
        if name in data and not declared.accepts(data[name]):
            value = data[name]
            problems.append(
                f"{data['kind']!r} field {name!r} is {type(value).__name__} {value!r:.60}, "
                f"expected {declared.name}"
            )
    return problems
