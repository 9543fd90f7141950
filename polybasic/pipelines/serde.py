"""Dataclasses <-> YAML with errors that name the offending field, and atomic text writes.

`from_dict(cls, data, path)` builds a dataclass tree from a mapping, rejecting unknown keys and
wrong types with the dotted field path (e.g. `quantize.calib.epochs`). A dataclass with a
`SHORTHAND` ClassVar also accepts a plain value, which fills that one field (`data: PATH` is
`data: {path: PATH}`).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml

from polybasic.artifacts import write_text
from polybasic.errors import ConfigError


def from_dict(cls, data, path: str = ""):
    """Build dataclass `cls` from a mapping, recursively; errors name the dotted path."""
    where = path or "recipe"
    if data is None:
        data = {}
    shorthand = getattr(cls, "SHORTHAND", None)  # a ClassVar naming the field a plain value fills
    if shorthand and not isinstance(data, dict):
        data = {shorthand: data}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; valid fields: {sorted(names)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:  # a __post_init__ check: prefix the dotted path of the section
        raise ConfigError(f"{where}: {e}") from None


def _coerce(tp, value, path: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        k_tp, v_tp = typing.get_args(tp) or (object, object)
        return {_coerce(k_tp, k, path): _coerce(v_tp, v, f"{path}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (object,)
        return [_coerce(inner, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe: file {p} does not exist; pass the path of a recipe YAML (see recipes/)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe: {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe: {p} must hold a mapping at the top level")
    return data



def dump_recipe(obj, path: str | Path) -> None:
    write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))
