"""One codec for the typed records that ride a node's pipeline log (pipeline/log.py LogEntry.info):
frozen dataclasses to JSON-safe values and back, every field checked against its declared type.

    to_json(record) -> dict                     its fields: bytes as hex, tuples as lists, nested records as dicts
    from_json(cls, data) -> cls                 ValueError naming the field (path) that does not fit

Field types it takes: int, float, str, bool, bytes, `X | None`, `tuple[X, ...]`, `tuple[X, Y]` and
nested dataclasses of those. A bool is not an int here, nor an int a bool; a float field takes an
int (JSON has one number type). What arrives is data, never code: nothing is looked up by a name the
sender chose (the receiver says which class it expects).
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields, is_dataclass


def to_json(record) -> dict:
    """The record's fields, JSON-safe."""
    return {f.name: _out(getattr(record, f.name)) for f in fields(record)}


def _out(v):
    if is_dataclass(v):
        return to_json(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, tuple | list):
        return [_out(x) for x in v]
    return v


def from_json(cls: type, data) -> object:
    """A `cls` from to_json's output; ValueError naming the first field that does not fit."""
    return _record(cls, data, cls.__name__)


@functools.cache
def _hints(cls: type) -> tuple[tuple[str, object], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in fields(cls))


def _record(cls: type, data, path: str):
    if not isinstance(data, dict):
        raise ValueError(f"{path} must be an object, got {type(data).__name__}")
    declared = _hints(cls)
    unknown = set(data) - {name for name, _ in declared}
    if unknown:
        raise ValueError(f"{path} has unknown fields: {', '.join(sorted(map(str, unknown)))}")
    values = {name: _in(kind, data[name], f"{path}.{name}") for name, kind in declared if name in data}
    try:
        return cls(**values)
    except TypeError as e:  # a required field is missing
        raise ValueError(f"{path}: {e}") from None


def _in(kind, v, path: str):
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # (only `X | None` is used)
        return _in(inner, v, path)
    if origin is tuple:
        if not isinstance(v, list):
            raise ValueError(f"{path} must be a list, got {type(v).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_in(args[0], x, f"{path}[{i}]") for i, x in enumerate(v))
        if len(v) != len(args):
            raise ValueError(f"{path} must hold {len(args)} values, got {len(v)}")
        return tuple(_in(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
    if is_dataclass(kind):
        return _record(kind, v, path)
    if kind is bytes:
        if not isinstance(v, str):
            raise ValueError(f"{path} must be hex text, got {type(v).__name__}")
        try:
            return bytes.fromhex(v)
        except ValueError:
            raise ValueError(f"{path} is not hex") from None
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if kind in (int, float, str, bool) and type(v) is kind:
        return v
    raise ValueError(f"{path} must be {getattr(kind, '__name__', kind)}, got {type(v).__name__}")
