"""Recipes: YAML jobs parsed into plain dataclasses, with errors that name the offending field.

A recipe is a tree of dataclasses; `from_dict(cls, data, path)` builds one from the YAML mapping,
rejecting unknown keys and wrong types with the dotted field path (e.g. `quantize.calib.epochs`).
The resolved recipe (every default filled in) is saved next to every output (`dump_recipe`).
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from polybasic.errors import ConfigError
from polybasic.quant.calibrate import CalibrationConfig

RECIPE_VERSION = 1


def from_dict(cls, data, path: str = ""):
    """Build dataclass `cls` from a mapping, recursively; errors name the dotted path."""
    where = path or "recipe"
    if data is None:
        data = {}
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


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temporary file and os.replace: readers never see a half-written file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, p)


def dump_recipe(obj, path: str | Path) -> None:
    atomic_write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))


@dataclass
class ModelSection:
    source: str = "smollm2-135m"  # short name, .gguf, HF folder or Hub id
    dtype: str = "float32"

    def __post_init__(self) -> None:
        from polybasic.models.loader import parse_dtype

        parse_dtype(self.dtype)


@dataclass
class RecipeHeader:
    """Fields every recipe has; stage sections are added by the stages (see pipelines/)."""

    name: str = "recipe"
    version: int = RECIPE_VERSION
    out_dir: str = "runs/recipe"
    model: ModelSection = field(default_factory=ModelSection)


DEFAULT_CALIB_DATA = "../shared/data/alpaca_1000/alpaca_data_cleaned_1000.json"




@dataclass
class QuantizeSection:
    """The `quantize` stage: calibrate (calib), evaluate a grid of schemes x methods, save one model.

    The saved model is calib.method at calib's bits, executed with `kernel` in `exec_dtype`.
    data: JSON list or JSONL of {instruction, input, output} (or {text}); the last `holdout`
    records are never used for calibration and are the evaluation text.
    """

    calib: CalibrationConfig = field(default_factory=CalibrationConfig)
    data: str = DEFAULT_CALIB_DATA
    holdout: int = 100
    eval_seq_len: int = 256
    eval_windows: int = 48  # at most this many held-out windows of eval_seq_len tokens
    schemes: list[str] = field(default_factory=lambda: ["w4a4", "w4a8", "w4a16"])
    methods: list[str] = field(default_factory=lambda: ["rtn", "omniquant", "affinequant"])
    kernel: str = "int4pack"
    exec_dtype: str = "bfloat16"
    quantize_lm_head: bool = False  # also run the LM head as w_bits weights (RTN) in the saved model
    latency_tokens: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    latency_context: int = 128
    latency_reps: int = 15

    def __post_init__(self) -> None:
        from polybasic.errors import check
        from polybasic.models.loader import parse_dtype
        from polybasic.quant.config import METHODS
        from polybasic.quant.calibrate import parse_scheme

        f = "quantize."
        for i, s in enumerate(self.schemes):
            parse_scheme(s, self.calib.group_size, f"{f}schemes[{i}]")
        for i, m in enumerate(self.methods):
            check(m in METHODS, f"{f}methods[{i}]", f"unknown method {m!r}", f"use one of {METHODS}")
        for name in ("holdout", "eval_seq_len", "eval_windows", "latency_context", "latency_reps"):
            v = getattr(self, name)
            check(v > 0, f + name, f"must be > 0, got {v}", "use a positive int")
        for i, k in enumerate(self.latency_tokens):
            check(k > 0, f"{f}latency_tokens[{i}]", f"must be > 0, got {k}", "use e.g. [1, 4, 8, 16]")
        try:
            parse_dtype(self.exec_dtype)
            self.calib.quant_config(self.kernel)
        except ConfigError as e:
            raise ConfigError(f"{f}kernel / {f}exec_dtype: {e}") from None


@dataclass
class Recipe(RecipeHeader):
    quantize: QuantizeSection = field(default_factory=QuantizeSection)


def load_recipe(path: str | Path) -> Recipe:
    """Parse a recipe YAML into a Recipe; every error names the field (before any heavy work)."""
    return from_dict(Recipe, load_yaml(path))
