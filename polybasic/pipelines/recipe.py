"""Recipes: YAML jobs parsed into plain dataclasses, with errors that name the offending field.

A recipe is a tree of dataclasses; `from_dict(cls, data, path)` builds one from the YAML mapping,
rejecting unknown keys and wrong types with the dotted field path (e.g. `quantize.calib.epochs`).
The resolved recipe (every default filled in) is saved next to every output (`dump_recipe`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from polybasic.data import DEFAULT_DATA, DataSource, resolve_path
from polybasic.errors import ConfigError, check
from polybasic.pipelines.distill import DistillSection
from polybasic.pipelines.sections import BenchSection, ExportSection, PlanSection, ProfileSection
from polybasic.pipelines.stages import NAMES
from polybasic.pipelines.serde import dump_recipe, from_dict, load_yaml, to_dict
from polybasic.quant.calibrate import CalibrationConfig

__all__ = ["Recipe", "RecipeHeader", "ModelSection", "QuantizeSection", "DistillSection", "load_recipe",
           "from_dict", "to_dict", "load_yaml", "dump_recipe"]

RECIPE_VERSION = 1


@dataclass
class ModelSection:
    source: str = "smollm2-135m"  # short name, .gguf, HF folder or Hub id
    dtype: str = "float32"
    device: str = "cpu"  # cpu, cuda or cuda:N: where every stage loads and runs the models

    def __post_init__(self) -> None:
        from polybasic.models.loader import parse_dtype
        from polybasic.runtime.context import parse_device

        parse_dtype(self.dtype)
        parse_device(self.device, "model.device")  # availability is checked when the recipe runs


@dataclass
class RecipeHeader:
    """Fields every recipe has; stage sections are added by the stages (see pipelines/)."""

    name: str = "recipe"
    version: int = RECIPE_VERSION
    out_dir: str = "runs/recipe"
    model: ModelSection = field(default_factory=ModelSection)


@dataclass
class QuantizeSection:
    """The `quantize` stage: calibrate (calib), evaluate a grid of schemes x methods, save one model.

    The saved model is calib.method at calib's bits, executed with `kernel` in `exec_dtype`.
    data: Alpaca, ShareGPT or {text} records (a DataSource: a file or a Hub id, see
    polybasic.data.DataSource; default the bundled Alpaca subset); the last `holdout` records are
    never used for calibration and are the evaluation text.
    """

    calib: CalibrationConfig = field(default_factory=CalibrationConfig)
    data: DataSource = field(default_factory=lambda: DataSource(DEFAULT_DATA))
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
    latency_reps: int = 15  # 0: no latency table (it holds fp32, bf16 and int8 copies: ~7x the fp32 model in memory)
    siblings: list[str] = field(default_factory=list)  # other model sources (same tokenizer) quantized alike

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
        for name in ("holdout", "eval_seq_len", "eval_windows", "latency_context"):
            v = getattr(self, name)
            check(v > 0, f + name, f"must be > 0, got {v}", "use a positive int")
        check(self.latency_reps >= 0, f + "latency_reps", f"must be >= 0, got {self.latency_reps}",
              "use 0 (no latency table) or a positive int")
        for i, src in enumerate(self.siblings):
            check(isinstance(src, str) and bool(src.strip()), f"{f}siblings[{i}]", f"is {src!r}",
                  "name a model source, e.g. qwen2.5-coder-0.5b")
        for i, k in enumerate(self.latency_tokens):
            check(k > 0, f"{f}latency_tokens[{i}]", f"must be > 0, got {k}", "use e.g. [1, 4, 8, 16]")
        try:
            parse_dtype(self.exec_dtype)
            self.calib.quant_config(self.kernel)
        except ConfigError as e:
            raise ConfigError(f"{f}kernel / {f}exec_dtype: {e}") from None


@dataclass
class Recipe(RecipeHeader):
    stages: list[str] = field(default_factory=lambda: list(NAMES))  # what `polybasic run` runs, in table order
    quantize: QuantizeSection = field(default_factory=QuantizeSection)
    distill: DistillSection = field(default_factory=DistillSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    plan: PlanSection = field(default_factory=PlanSection)
    export: ExportSection = field(default_factory=ExportSection)
    bench: BenchSection = field(default_factory=BenchSection)

    def __post_init__(self) -> None:
        for i, name in enumerate(self.stages):
            check(name in NAMES, f"stages[{i}]", f"unknown stage {name!r}", f"use some of {', '.join(NAMES)}")


def load_recipe(path: str | Path) -> Recipe:
    """Parse a recipe YAML into a Recipe; every error names the field (before any heavy work).

    Relative data paths written in the recipe (quantize.data, distill.data, distill.quantized)
    are made absolute against the recipe file's folder; out_dir stays relative to the current
    directory. Defaults are absolute already (the bundled data beside the repo checkout).
    """
    recipe = from_dict(Recipe, load_yaml(path))
    base = Path(path).absolute().parent
    recipe.quantize.data = recipe.quantize.data.resolved(base)
    recipe.distill.data = recipe.distill.data.resolved(base)
    recipe.profile.data = recipe.profile.data.resolved(base)
    if recipe.distill.quantized:
        recipe.distill.quantized = resolve_path(recipe.distill.quantized, base)
    return recipe
