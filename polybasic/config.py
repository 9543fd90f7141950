"""The recipe schema: every section of a recipe YAML as a plain dataclass, with its defaults and its
checks, in one place (docs/recipes.md is generated from it: `polybasic recipes --fields`).

A recipe is a tree of dataclasses; `from_dict(cls, data, path)` builds one from the YAML mapping,
rejecting unknown keys and wrong types with the dotted field path (e.g. `quantize.calib.epochs`), and
`apply_overrides` applies `--set section.field=value` (every recipe command and experiment takes it).
The configs the library itself consumes live here too (QuantConfig, CalibrationConfig, TrainConfig,
SamplingConfig), so a recipe section is the very object the stage hands down. No torch: checking a
recipe costs nothing. Layer: above `data` (DataSource), below `models`.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from importlib.resources import files
from pathlib import Path

import yaml

from polybasic.artifacts import write_text
from polybasic.data import DEFAULT_DATA, DataSource, resolve_path
from polybasic.errors import ConfigError, check

RECIPE_VERSION = 1
DEFAULT_MODEL = "smollm2-135m"  # the target when none is named (a packaged GGUF: polybasic.models.registry)
# compiled steps on a CPU (models.prepare.compile_for_device): one graph per layer and size, run by every layer
# (the default: seconds to compile), or one graph of the whole model per size (minutes; steps ~5% faster)
COMPILE_MODES = ("layers", "whole")
STAGE_NAMES = ("quantize", "distill", "profile", "plan", "export", "bench")  # pipelines.stages.STAGES, in order
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16"}


def check_device_name(device: str, field: str) -> str:
    """`device` if it names a device polybasic runs on (cpu, cuda, cuda:N), whether or not this machine
    has it (a recipe for a GPU cluster is read anywhere); else a ConfigError naming `field`."""
    check(isinstance(device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", device) is not None, field,
          f"unknown device {device!r}", "use cpu, cuda or cuda:N")
    return device


def check_search_space(k_values: list[int], thresholds: list[int], max_levels: int) -> None:
    """The planner's search space (planner.search.SearchSpace, the recipe's plan section), checked."""
    check(bool(k_values) and min(k_values) >= 1, "k_values",
          f"must be integers >= 1, got {k_values}", "e.g. [1, 2, 3, 4, 5]")
    check(bool(thresholds) and min(thresholds) >= 1, "thresholds",
          f"must be integers >= 1, got {thresholds}", "e.g. [2, 4, 6, 8]")
    check(max_levels >= 2, "max_levels", f"must be >= 2, got {max_levels}", "a chain has >= 2 levels")


def check_draft_confidence(c: float, field: str = "draft_confidence") -> float:
    """A draft confidence (runtime.chain.Chain.draft_confidence) in [0, 1), or a ConfigError naming `field`."""
    check(isinstance(c, (int, float)) and not isinstance(c, bool) and 0.0 <= c < 1.0, field,
          f"must be in [0, 1), got {c!r}",
          "e.g. 0.5 (end a draft after a token its drafter gave under 50%), or 0 to draft k tokens always")
    return float(c)


def check_dtype(name: str, field: str = "dtype") -> str:
    """name if it is a dtype spelling polybasic accepts."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"{field}: unknown dtype '{name}'; use one of {', '.join(DTYPE_NAMES)}")
    return name


# ---- sampling -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}",
              "use 0 for greedy decoding or a positive value for sampling")
        check(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}", "use 0 to disable top-k")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}",
              "use 1.0 to disable nucleus sampling")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# ---- quantization -------------------------------------------------------------------------------
QUANT_CONFIG_VERSION = 1
BITS = (4, 8, 16)
METHODS = ("rtn", "omniquant", "affinequant", "gguf")
UNTRAINED = ("rtn", "gguf")  # methods that learn nothing: calibration only propagates the blocks
KERNELS = ("auto", "int4pack", "int8mm", "dequant", "w4a8")
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class QuantConfig:
    """a_bits=16: activations not quantized (w_bits=16 is reserved, rejected for now).
    group_size: input channels per weight group, or -1 for one group per output channel.
    a_symmetric defaults to False (asymmetric): post-RMSNorm and post-SiLU activations are far
    from zero-centred, and an integer zero point is free in the int8mm kernel (row-sum trick).
    kernel 'int4pack' is weight-only: it runs activations in the model dtype whatever a_bits says (the
    fast CPU path; docs/architecture.md). kernel 'w4a8' (CPU, groups of 32) quantizes activations to int8 per group
    of 32 at run time whatever a_bits says (AVX-512 VNNI; elsewhere it runs int4pack's kernel); 'auto' never
    picks it."""

    w_bits: int = 4
    a_bits: int = 16
    group_size: int = 64
    w_symmetric: bool = False
    a_symmetric: bool = False
    method: str = "rtn"
    kernel: str = "auto"
    quantize_lm_head: bool = False
    version: int = QUANT_CONFIG_VERSION

    def __post_init__(self) -> None:
        f = "QuantConfig."
        check(self.version == QUANT_CONFIG_VERSION, f + "version",
              f"is {self.version}, this polybasic reads version {QUANT_CONFIG_VERSION}",
              "upgrade polybasic (newer checkpoint) or re-quantize the model")
        for name in ("w_bits", "a_bits"):
            v = getattr(self, name)
            check(isinstance(v, int) and v in BITS, f + name, f"must be one of {BITS}, got {v!r}",
                  "use 4 or 8 (16 = keep floating point)")
        check(self.w_bits != 16, f + "w_bits", "16 (float weights, activation-only quantization) is "
              "not implemented", "use w_bits 4 or 8, or leave the model unquantized")
        g = self.group_size
        check(isinstance(g, int) and (g > 0 or g == -1), f + "group_size",
              f"must be a positive int or -1, got {g!r}", "use e.g. 64, 128 or -1 (per output channel)")
        for name in ("w_symmetric", "a_symmetric", "quantize_lm_head"):
            check(isinstance(getattr(self, name), bool), f + name,
                  f"must be a bool, got {getattr(self, name)!r}", "use true or false")
        check(self.method in METHODS, f + "method", f"unknown method {self.method!r}",
              f"use one of {METHODS}")
        check(self.kernel in KERNELS, f + "kernel", f"unknown kernel {self.kernel!r}",
              f"use one of {KERNELS}")
        if self.method == "gguf":
            check(self.w_bits == 4 and g == 32 and not self.w_symmetric, f + "method",
                  f"'gguf' keeps the file's 4-bit codes in groups of 32 (asymmetric), got "
                  f"w_bits={self.w_bits}, group_size={g}, w_symmetric={self.w_symmetric}",
                  "set w_bits: 4, group_size: 32, w_symmetric: false, or use method rtn")
            check(self.kernel != "int8mm", f + "kernel", "'int8mm' needs integer zero points; method "
                  "'gguf' has float ones", "use kernel: int4pack, dequant or auto")
        if self.kernel == "int4pack":
            check(self.w_bits == 4, f + "kernel", f"'int4pack' needs w_bits=4, got {self.w_bits}",
                  "set w_bits: 4 or kernel: dequant")
            check(g in INT4PACK_GROUP_SIZES, f + "group_size",
                  f"kernel 'int4pack' supports group sizes {INT4PACK_GROUP_SIZES}, got {g}",
                  "pick one of those or kernel: dequant")
        if self.kernel == "w4a8":
            check(self.w_bits == 4 and g == 32, f + "kernel",
                  f"'w4a8' needs w_bits=4 in groups of 32, got w_bits={self.w_bits}, group_size={g}",
                  "set w_bits: 4 and group_size: 32, or kernel: int4pack")
        if self.kernel == "int8mm":
            check(self.w_bits <= 8 and self.a_bits <= 8, f + "kernel",
                  f"'int8mm' needs w_bits and a_bits <= 8, got w{self.w_bits}a{self.a_bits}",
                  "use kernel: int4pack (weight-only) or dequant")
            check(g == -1, f + "group_size", f"kernel 'int8mm' needs per-channel weights, got {g}",
                  "set group_size: -1 or kernel: dequant")

    @property
    def float_zero(self) -> bool:
        """Zero points are fp32 (any real offset), not integers: method 'gguf'."""
        return self.method == "gguf"

    @property
    def name(self) -> str:
        """Short human label, e.g. 'w4a16-g64-asym' (for logs only, never for file names)."""
        g = "ch" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.w_bits}a{self.a_bits}-{g}-{'sym' if self.w_symmetric else 'asym'}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"QuantConfig: expected a mapping, got {type(d).__name__}; "
                              "pass the dict written by QuantConfig.to_dict")
        version = d.get("version", QUANT_CONFIG_VERSION)
        if isinstance(version, int) and version > QUANT_CONFIG_VERSION:
            raise ConfigError(f"QuantConfig.version: {version} is newer than this polybasic reads "
                              f"({QUANT_CONFIG_VERSION}); upgrade polybasic")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"QuantConfig: unknown fields {unknown}; remove them (known: "
                              f"{[f.name for f in fields(cls)]})")
        return cls(**d)


@dataclass
class CalibrationConfig:
    method: str = "affinequant"  # rtn | omniquant | affinequant | gguf (the GGUF file's codes: quant.from_gguf)
    w_bits: int = 4  # weight bits: 4 or 8 (16 is rejected)
    a_bits: int = 4  # activation bits: 4, 8 or 16 (16: activations not quantized); quantized per token
    group_size: int = 64  # input channels per weight group; -1: one group per output channel
    # (it must divide every block linear's in_features)
    w_symmetric: bool = False  # true: symmetric weight grid (zero point 0); false: integer zero point per group
    a_symmetric: bool = False  # true: symmetric per-token activation grid; false: with a zero point
    n_samples: int = 32  # calibration windows
    seq_len: int = 256  # tokens per window
    epochs: int = 2  # training epochs per block (0: initial scales and clipping kept; rtn and gguf never train)
    batch_size: int = 2  # calibration windows per optimizer step
    lr_transform: float = 5e-3  # AdamW learning rate of the scales and the affine matrices
    lr_clip: float = 1e-2  # AdamW learning rate of the weight-clipping logits
    stability: float = 1e-2  # AffineQuant's stability factor on the off-diagonal mask bands
    smooth_alpha: float = 0.5  # SmoothQuant migration strength of the scale initialisation
    clip_init: float = 4.0  # clipping logits start at sigmoid(4) = 0.982 (OmniQuant)
    transforms_weight_only: bool = False  # learn transforms also when a_bits = 16
    seed: int = 0  # seeds each block's per-epoch order of the calibration windows

    def __post_init__(self) -> None:
        f = "CalibrationConfig."
        check(self.method in METHODS, f + "method", f"unknown method {self.method!r}", f"use one of {METHODS}")
        for name in ("n_samples", "seq_len", "batch_size"):
            v = getattr(self, name)
            check(isinstance(v, int) and v > 0, f + name, f"must be a positive int, got {v!r}", "fix it")
        check(isinstance(self.epochs, int) and self.epochs >= 0, f + "epochs",
              f"must be an int >= 0, got {self.epochs!r}", "use e.g. 2")
        for name in ("lr_transform", "lr_clip", "stability"):
            v = getattr(self, name)
            check(v >= 0 and math.isfinite(v), f + name, f"must be finite and >= 0, got {v!r}", "fix it")
        check(0 <= self.smooth_alpha <= 1, f + "smooth_alpha", f"must be in [0, 1], got {self.smooth_alpha}",
              "use 0.5")
        check(self.w_bits in BITS and self.a_bits in BITS, f + "w_bits",
              f"bits must be in {BITS}, got w{self.w_bits}a{self.a_bits}", "use e.g. w_bits 4, a_bits 4")
        self.quant_config()  # validates bits / group size combinations

    def quant_config(self, kernel: str = "dequant") -> QuantConfig:
        return QuantConfig(self.w_bits, self.a_bits, self.group_size, self.w_symmetric,
                           self.a_symmetric, self.method, kernel)

    @property
    def uses_transforms(self) -> bool:
        return self.method not in UNTRAINED and (self.a_bits < 16 or self.transforms_weight_only)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_scheme(scheme: str, group_size: int, field: str = "scheme") -> tuple[int, int, int]:
    """'w4a4' or 'w4a16-g32' -> (w_bits, a_bits, group_size); ConfigError naming `field`."""
    m = re.fullmatch(r"w(\d+)a(\d+)(?:-g(-?\d+))?", str(scheme))
    check(m is not None, field, f"cannot parse scheme {scheme!r}", "write e.g. w4a4, w4a8, w4a16 or w4a16-g32")
    w, a, g = int(m[1]), int(m[2]), int(m[3]) if m[3] else group_size
    QuantConfig(w, a, g)  # validates the bits and the group size
    return w, a, g

# ---- drafter training ---------------------------------------------------------------------------
TRAIN_VERSION = 1
STRATEGIES = ("auto", "ddp", "deepspeed_stage_2")
REGRESS = ("prenorm", "postnorm", "none")  # see the module docstring


@dataclass
class TrainConfig:
    lr: float = 3e-4  # AdamW peak learning rate of the head (schedule: warmup_steps)
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW (beta1, beta2)
    v_weight: float = 1.0  # weight of the feature-regression loss (smooth-L1, see regress)
    p_weight: float = 1.0  # weight of the token loss (cross-entropy vs the base's next-token distribution)
    regress: str = "prenorm"  # the feature regression's target: prenorm | postnorm | none (module docstring)
    noise_std: float = 0.0  # uniform feature noise of this width, times the feature's RMS
    ttt_steps: int = 1  # > 1: training-time test (EAGLE-3), the head also learns from its own drafts
    ttt_decay: float = 0.8  # loss weight of step j is ttt_decay**(j-1), normalised to sum to 1
    grad_clip: float = 0.5  # max gradient norm (0: no clipping)
    warmup_steps: int = 50  # linear warm-up, then linear decay to 5% of lr at the last step
    prompt_loss: bool = False  # also learn on prompt positions (more data per sequence)
    compile_loss: bool = True  # torch.compile the loss's passes over the vocabulary (needs a C++ compiler on CPU)
    init_from_base: bool = True  # start the head's block from the base's last decoder layer
    batch_size: int = 4  # sequences per optimizer step on each device (batched by similar length)
    max_len: int = 1024  # training sequences are cut to this many tokens
    max_epochs: int = 1  # passes over the distillation set
    max_steps: int = -1  # stop after this many optimizer steps; -1: no limit (max_epochs decides)
    checkpoint_every_n_steps: int = 200  # last.ckpt also every N optimizer steps (0: only at epoch ends)
    strategy: str = "auto"  # auto | ddp | deepspeed_stage_2 (ZeRO stage 2, CUDA GPUs only)
    devices: int = 1  # devices Lightning trains on (one process each)
    precision: str = "32-true"  # Lightning's precision: 32-true, bf16-mixed, 16-mixed, ...
    seed: int = 0  # seeds the head's initialisation, the per-epoch batch order and the feature noise
    log_every: int = 1  # Lightning's log_every_n_steps (no logger is attached: little effect)
    version: int = TRAIN_VERSION  # the training config's format version; must be 1

    def __post_init__(self) -> None:
        check(self.strategy in STRATEGIES, "strategy", f"is {self.strategy!r}",
              f"use one of {', '.join(STRATEGIES)}")
        check(self.regress in REGRESS, "distill.train.regress", f"is {self.regress!r}",
              f"use one of {', '.join(REGRESS)} (prenorm: the pre-norm feature, postnorm: the final "
              "norm's output as EAGLE-1, none: token loss only as EAGLE-3)")
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}", "use e.g. 3e-4")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}", "use 1 or more")
        check(self.ttt_steps >= 1, "ttt_steps", f"must be >= 1, got {self.ttt_steps}",
              "use 1 (teacher-forced only) or the draft length to train for, e.g. 3")
        check(0 < self.ttt_decay <= 1, "ttt_decay", f"must be in (0, 1], got {self.ttt_decay}", "use e.g. 0.8")
        check(self.devices >= 1, "devices", f"must be >= 1, got {self.devices}", "use 1 or more")
        check(isinstance(self.checkpoint_every_n_steps, int) and self.checkpoint_every_n_steps >= 0,
              "checkpoint_every_n_steps", f"must be an int >= 0, got {self.checkpoint_every_n_steps!r}",
              "use e.g. 200 (0: checkpoint only at the end of each epoch)")
        check(self.version == TRAIN_VERSION, "version", f"is {self.version}, expected {TRAIN_VERSION}",
              "regenerate the recipe")


def check_feature_layers(layers, field: str) -> list[int]:
    """`layers` as a list, checked: distinct increasing 0-based decoder layer indices (their range against a
    model: Transformer.use_feature_layers)."""
    ok = isinstance(layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in layers)
    check(ok and list(layers) == sorted(set(layers)), field,
          f"must be a list of distinct increasing layer indices, got {layers!r}",
          "use [] (the last layer only) or e.g. [2, 15] (0-based decoder layers below the last)")
    return list(layers)


# ---- the recipe's sections ----------------------------------------------------------------------
OWN_LEVELS = ("quantized", "eagle:target", "eagle:quantized")
SIBLING = "quantized:"  # `quantized:SOURCE`: the quantize stage's copy of the sibling model SOURCE

DRAFTERS = ("target", "quantized")
HEAD_ARCHS = ("eagle1", "eagle3")  # models.eagle_head.ARCHS


@dataclass
class ModelSection:
    source: str = DEFAULT_MODEL  # short name, .gguf, HF folder or Hub id
    dtype: str = "float32"  # the dtype every stage loads the target in: float32, bfloat16 or float16
    # (or fp32, bf16, fp16); the quantize stage calibrates an fp32 copy whatever it says
    device: str = "cpu"  # cpu, cuda or cuda:N: where every stage loads and runs the models

    def __post_init__(self) -> None:
        check_dtype(self.dtype, "model.dtype")
        check_device_name(self.device, "model.device")  # availability is checked when the recipe runs


@dataclass
class RecipeHeader:
    """Fields every recipe has; stage sections are added by the stages (see pipelines/)."""

    name: str = "recipe"  # the recipe's label (kept in the resolved recipe.yaml and the bundle; nothing else reads it)
    description: str = ""  # one line: what the recipe is for (`polybasic recipes` prints it)
    version: int = RECIPE_VERSION  # the recipe format's version; 1, the only one so far (not checked yet)
    out_dir: str = "runs/recipe"  # where every stage writes, relative to the current directory (`--out` overrides it)
    model: ModelSection = field(default_factory=ModelSection)  # the target: its source, dtype, device


@dataclass
class QuantizeSection:
    """The `quantize` stage: calibrate (calib), evaluate a grid of schemes x methods, save one model.

    The saved model is calib.method at calib's bits, executed with `kernel` in `exec_dtype`.
    data: Alpaca, ShareGPT or {text} records (a DataSource: a file or a Hub id, see
    polybasic.data.DataSource; default the bundled Alpaca subset); the last `holdout` records are
    never used for calibration and are the evaluation text.
    """

    calib: CalibrationConfig = field(default_factory=CalibrationConfig)  # the calibration, and the saved model's scheme
    data: DataSource = field(default_factory=lambda: DataSource(DEFAULT_DATA))  # calibration and evaluation records
    # (the last `holdout` of them are the evaluation text)
    holdout: int = 100  # the last N records of data: never calibrated on, the evaluation text (< the record count)
    eval_seq_len: int = 256  # tokens per held-out evaluation window (perplexity, top-1 agreement with fp)
    eval_windows: int = 48  # at most this many held-out windows of eval_seq_len tokens
    schemes: list[str] = field(default_factory=lambda: ["w4a4", "w4a8", "w4a16"])  # the grid's schemes, wWaA[-gG]
    # (group size default: calib.group_size)
    methods: list[str] = field(default_factory=lambda: ["rtn", "omniquant", "affinequant"])  # the grid's methods
    # (rtn, omniquant, affinequant, gguf): every scheme x method is evaluated, only calib's is saved
    kernel: str = "int4pack"  # the saved model's kernel: auto | int4pack | int8mm | dequant | w4a8 (see QuantConfig)
    exec_dtype: str = "bfloat16"  # the saved model's run-time dtype: float32, bfloat16, float16 (or fp32, bf16, fp16)
    quantize_lm_head: bool = False  # also run the LM head as w_bits weights (RTN) in the saved model
    latency_tokens: list[int] = field(default_factory=lambda: [1, 4, 8, 16])  # latency table columns: M per forward
    latency_context: int = 128  # tokens of context prefilled before each timed forward (latency table)
    latency_reps: int = 15  # 0: no latency table (it holds fp32, bf16 and int8 copies: ~7x the fp32 model in memory)
    siblings: list[str] = field(default_factory=list)  # other model sources (same tokenizer) quantized alike

    def __post_init__(self) -> None:
        f = "quantize."
        self.data.check_not_benchmark(f + "data")
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
            check_dtype(self.exec_dtype, f + "exec_dtype")
            self.calib.quant_config(self.kernel)
        except ConfigError as e:
            raise ConfigError(f"{f}kernel / {f}exec_dtype: {e}") from None


@dataclass
class DistillSection:
    """The `distill` stage. data: Alpaca or ShareGPT records (a DataSource: a file or a Hub id, see
    polybasic.data.DataSource; default the bundled Alpaca subset; never the Spec-Bench questions),
    of which the first `limit` are used. quantized: a relative path in a recipe is relative to
    the recipe's folder."""

    data: DataSource = field(default_factory=lambda: DataSource(DEFAULT_DATA))  # prompts (and reference answers)
    # to self-distill: its first `limit` records
    limit: int = 1000  # first N records
    more_data: list[DataSource] = field(default_factory=list)  # more prompt sets, each answered in full after
    # data's (their references too, where they have some and `references` is on); each keeps its own generation
    # shards, so adding a set keeps the answers and features made before
    self_instruct: int = 0  # > 0: also this many prompts the target writes itself (Magpie), for diversity
    self_instruct_openings: list[str] = field(default_factory=list)  # the self-written prompts' turns begin
    # with these, in turn (task-seeded: "Summarize the following article:\n\n"; "" is a free turn)
    max_new_tokens: int = 128  # the longest answer the target writes to a prompt, in tokens (EOS ends it sooner)
    temperature: float = 0.0  # 0: greedy answers
    max_prompt_tokens: int = 512  # a longer prompt keeps only its last N tokens
    # (reference sequences are cut to max_prompt_tokens + max_new_tokens)
    seed: int = 0  # seeds the answers' sampling (temperature > 0) and the self-instruct prompts
    gen_batch_size: int = 32  # prompts per batched decode loop
    gen_dtype: str = "bfloat16"  # the target answers in this dtype (a bf16 copy is ~2x faster on CPU);
    # float32: the answers an fp32 target gives (a bf16 copy's greedy answers drift from them)
    references: bool = True  # also learn from the dataset's own answers (teacher-forced, off-policy)
    features: str = "cache"  # cache: one batched prefill, safetensors shards; online: every step
    feature_dtype: str = "bfloat16"  # the float target's features (and soft targets) come from a copy in
    # this dtype and are cached in it; float32: exactly the fp32 target's (twice the cache)
    feature_batch_tokens: int = 4096  # about this many tokens per batched prefill of the feature cache
    drafters: list[str] = field(default_factory=lambda: ["target"])  # bases that get an EAGLE head: target
    # (the recipe's model) and/or quantized (its quantized copy)
    quantized: str = ""  # the quantized copy; default <out_dir>/model.safetensors
    head_arch: str = "eagle1"  # eagle1: today's head (fc over token and last feature, the base's LM head);
    # eagle3: vLLM's EAGLE-3 drafter (fc over feature_layers, its own norm and LM head; train.regress: none;
    # exportable in the speculators format, see models.eagle_head)
    draft_vocab_size: int = 0  # > 0: EAGLE-3 style reduced draft vocabulary
    head_layers: int = 1  # decoder blocks in each head (eagle3: 1)
    feature_residual: bool = True  # the head's blocks read f_p + fc(...) (DrafterConfig.feature_residual; eagle1)
    feature_layers: list[int] = field(default_factory=list)  # also read these base layers' outputs (eagle1);
    # eagle3: the layers fc fuses ([] = vLLM's aux layer ids 2, n//2, n-3, i.e. the outputs of layers
    # 1, n//2-1, n-4; exported as eagle_aux_hidden_state_layer_ids = these + 1)
    train: TrainConfig = field(default_factory=TrainConfig)  # how the heads are trained

    def __post_init__(self) -> None:
        check(self.self_instruct >= 0, "distill.self_instruct", f"must be >= 0, got {self.self_instruct}",
              "use 0 (off) or the number of prompts the target should write")
        check(not self.self_instruct_openings or self.self_instruct > 0, "distill.self_instruct_openings",
              "is set but self_instruct is 0", "set self_instruct to the number of prompts to write")
        for name in ("limit", "max_new_tokens", "max_prompt_tokens", "gen_batch_size", "feature_batch_tokens",
                     "head_layers"):
            check(getattr(self, name) > 0, f"distill.{name}", f"must be > 0, got {getattr(self, name)}",
                  "use a positive int")
        self.data.check_not_benchmark("distill.data")
        for i, src in enumerate(self.more_data):
            src.check_not_benchmark(f"distill.more_data[{i}]")
        check(self.features in ("cache", "online"), "distill.features", f"is {self.features!r}",
              "use 'cache' or 'online'")
        check(bool(self.drafters) and set(self.drafters) <= set(DRAFTERS), "distill.drafters",
              f"is {self.drafters}", f"list one or both of {', '.join(DRAFTERS)}")
        for name in ("gen_dtype", "feature_dtype"):
            check(getattr(self, name) in DTYPE_NAMES, f"distill.{name}", f"is {getattr(self, name)!r}",
                  f"use one of {', '.join(DTYPE_NAMES)} (float32: exactly the fp32 target's numerics)")
        check(isinstance(self.feature_residual, bool), "distill.feature_residual",
              f"must be true or false, got {self.feature_residual!r}", "use true (default) or false")
        self.feature_layers = check_feature_layers(self.feature_layers, "distill.feature_layers")
        check(self.head_arch in HEAD_ARCHS, "distill.head_arch", f"is {self.head_arch!r}",
              f"use one of {', '.join(HEAD_ARCHS)}")
        if self.head_arch == "eagle3":
            check(self.train.regress == "none", "distill.train.regress", f"is {self.train.regress!r}, and an "
                  "eagle3 head predicts no base feature", "set distill.train.regress: none")
            check(self.head_layers == 1, "distill.head_layers", f"is {self.head_layers}; an eagle3 head has one "
                  "decoder layer", "use 1")
            check(self.feature_residual, "distill.feature_residual", "is false, an eagle1 option",
                  "leave it at true for an eagle3 head")
        check(isinstance(self.references, bool), "distill.references",
              f"must be true or false, got {self.references!r}", "use true (default) or false")
        SamplingConfig(temperature=self.temperature)


def section_from_dict(data: dict) -> DistillSection:
    return from_dict(DistillSection, data, "distill")


@dataclass
class ProfileSection:
    """What the profile stage measures: every candidate level's forward cost T_i(M) at `context`
    tokens of context, and every verifier <- drafter pair's acceptance at draft length `k` on the
    last `prompts` records of `data` (held out: they must not be among the distill stage's)."""

    levels: list[str] = field(default_factory=lambda: ["quantized", "eagle:target", "eagle:quantized", "ngram"])
    # candidate levels below the target: quantized, eagle:target, eagle:quantized (either @KERNEL: its block on
    # 4-bit weights, e.g. eagle:target@w4a8), quantized:SOURCE (a
    # quantize.siblings copy) or any --chain level (ngram[:N], PATH.safetensors, target@DTYPE, SOURCE[@DTYPE],
    # eagle:PATH); eagle:X is skipped unless distill.drafters lists X (eagle:quantized: and quantized is a level)
    data: DataSource = field(default_factory=lambda: DataSource(DEFAULT_DATA))  # acceptance prompts: its last `prompts`
    # records (they must not be among distill's training records)
    prompts: int = 8  # held-out prompts each pair's acceptance is measured on
    max_new_tokens: int = 64  # tokens generated per prompt when measuring a pair's acceptance
    k: int = 5  # draft length at which acceptance is measured (also the bench stage's --draft-tokens)
    measured_k_values: list[int] = field(default_factory=list)  # draft lengths at which a drafter whose drafts'
    # shape is measured, not modelled (token trees; drafts cut by export.draft_confidence) is profiled, each one
    # planned; empty: k alone
    context: int = 256  # tokens of (random) context each forward's cost is timed at
    reps: int = 5  # timed repetitions per forward (the median counts; after 2 warm-up calls)
    temperature: float = 0.0  # the sampling the chain will run with (acceptance depends on it)
    top_p: float = 1.0  # nucleus sampling the chain will run with (1.0 = off)
    compile: bool = False  # time every level on compiled steps, as `generate --compile` and the bench's *-compiled
    # methods run it (the baseline is then compiled plain decoding too); false: eager forwards

    def __post_init__(self) -> None:
        check(all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in self.measured_k_values),
              "profile.measured_k_values", f"must be integers >= 1, got {self.measured_k_values!r}", "e.g. [2, 3]")
        check(isinstance(self.compile, bool), "profile.compile", f"must be true or false, got {self.compile!r}",
              "write compile: true to time compiled steps")
        for name in ("prompts", "max_new_tokens", "k", "context", "reps"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, f"profile.{name}", f"must be an integer >= 1, got {v!r}",
                  "use a positive int")
        check(bool(self.levels), "profile.levels", "is empty", f"list candidate levels, e.g. {OWN_LEVELS}")
        self.data.check_not_benchmark("profile.data")
        SamplingConfig(temperature=self.temperature, top_p=self.top_p)


@dataclass
class PlanSection:
    """The planner's search space (polybasic.planner.search.SearchSpace): draft lengths, middle levels'
    thresholds, the longest chain."""

    k_values: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])  # bottom level's draft lengths to try
    thresholds: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 10])  # thresholds to try per middle level
    # (tokens it gathers before handing them up); every combination is predicted
    max_levels: int = 4  # the most levels in a chain, the target included (>= 2)
    new_tokens: int = 128  # prefill is amortised over this many new tokens

    def __post_init__(self) -> None:
        check_search_space(self.k_values, self.thresholds, self.max_levels)


@dataclass
class ExportSection:
    folder: str = "bundle"  # inside out_dir
    draft_confidence: float = 0.0  # the bundle's drafting levels end a draft after a token they gave a
    # probability below this (0: off; lossless either way); the profile measures its model and head drafters' drafts
    # (paths, or a tree's path) with it (at profile.measured_k_values) and the plan prices the drafts' measured lengths

    def __post_init__(self) -> None:
        check_draft_confidence(self.draft_confidence, "export.draft_confidence")


@dataclass
class BenchSection:
    """The bench stage: the bundle's chain beside vanilla on Spec-Bench questions."""

    questions: str = "spec-bench"  # a shipped question set's short name, or a JSON-lines file
    per_category: int = 1  # the first N questions of each category (file order)
    categories: list[str] = field(default_factory=list)  # empty: all
    max_new_tokens: int = 128  # the most tokens each method generates per question (EOS ends it sooner)
    methods: str = "vanilla,chain"  # comma-separated, as `polybasic bench --methods` (empty: vanilla,chain)
    warmup: int = 1  # untimed warm-up runs of every method on the first N questions (0: none)
    repeat: int = 1  # runs of every method on each question, interleaved; the fastest is kept (bench --repeat)

    def __post_init__(self) -> None:
        for name, low in (("per_category", 1), ("max_new_tokens", 1), ("warmup", 0), ("repeat", 1)):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= low, f"bench.{name}", f"must be an integer >= {low}, got {v!r}",
                  f"use {low} or more")


@dataclass
class Recipe(RecipeHeader):
    stages: list[str] = field(default_factory=lambda: list(STAGE_NAMES))  # what `polybasic run` runs, in table order
    quantize: QuantizeSection = field(default_factory=QuantizeSection)  # calibrate and quantize the target
    distill: DistillSection = field(default_factory=DistillSection)  # train EAGLE drafter heads
    profile: ProfileSection = field(default_factory=ProfileSection)  # measure levels' costs and pairs' acceptance
    plan: PlanSection = field(default_factory=PlanSection)  # rank candidate chains
    export: ExportSection = field(default_factory=ExportSection)  # the planned chain as a bundle
    bench: BenchSection = field(default_factory=BenchSection)  # the bundle's chain vs vanilla

    def __post_init__(self) -> None:
        for i, name in enumerate(self.stages):
            check(name in STAGE_NAMES, f"stages[{i}]", f"unknown stage {name!r}",
                  f"use some of {', '.join(STAGE_NAMES)}")


# ---- YAML <-> dataclasses -----------------------------------------------------------------------
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
    if tp is float and isinstance(value, str):
        value = _as_float(value)
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe: file {p} does not exist; pass a shipped recipe's name "
                          f"({', '.join(shipped_recipes())}) or the path of a recipe YAML")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe: {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe: {p} must hold a mapping at the top level")
    return data


def dump_recipe(obj, path: str | Path) -> None:
    write_text(path, yaml.safe_dump(to_dict(obj), sort_keys=False))


def parse_assignments(items: list[str] | tuple[str, ...], flag: str = "--set") -> dict:
    """KEY=VALUE items -> {dotted key: value}: the one override syntax of every recipe command and
    experiment. Values are read as YAML (numbers, true/false, lists, mappings; YAML 1.1 reads 1e-2 as
    text, which a float field takes as a number); errors name `flag`."""
    out = {}
    for item in items:
        key, eq, text = item.partition("=")
        check(bool(eq) and all(key.strip().split(".")), flag, f"{item!r} is not KEY=VALUE",
              "write e.g. distill.train.lr=1e-2 (a dotted field path, '=', a YAML value)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{flag}: the value of {key.strip()} is not YAML: {e}") from None
        out[key.strip()] = value
    return out


def set_fields(data: dict, assignments: dict, flag: str = "--set") -> dict:
    """A deep copy of the mapping `data` with each dotted key of `assignments` set (missing sections
    made; a float field given a number as text, "1e-3", takes the number). The keys are checked when the
    recipe is built (from_dict names the dotted path)."""
    out = copy.deepcopy(data)
    for key, value in assignments.items():
        parts, node = key.split("."), out
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if nxt is None:
                nxt = node[part] = {}
            check(isinstance(nxt, dict), flag, f"{'.'.join(parts[:i + 1])} is {nxt!r}, not a section",
                  f"set the whole value instead: {'.'.join(parts[:i + 1])}=VALUE")
            node = nxt
        node[parts[-1]] = _as_float(value) if isinstance(node.get(parts[-1]), float) else value
    return out


def _as_float(value):
    """A number written as text ("1e-3": YAML 1.1 reads it so) as a float; anything else unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """`data` (a recipe's YAML mapping) with each `section.field=value` item (`--set`) written in."""
    return set_fields(data, parse_assignments(overrides))


def shipped_recipes() -> dict[str, Path]:
    """The recipes polybasic ships as package data, name -> file (`polybasic recipes` lists them)."""
    folder = files("polybasic") / "recipes"
    return {Path(f.name).stem: Path(str(f)) for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".yaml")}


def recipe_path(recipe: str | Path) -> Path:
    """The recipe file: a path to a YAML file, else a shipped recipe's name (`smollm2-smoke`)."""
    p = Path(recipe).expanduser()
    if p.is_file():
        return p
    shipped = shipped_recipes()
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    if p.parent == Path(".") and name in shipped:
        return shipped[name]
    raise ConfigError(f"recipe: {recipe} is neither a file nor a shipped recipe; pass a path to a recipe YAML "
                      f"or one of {', '.join(shipped)} (`polybasic recipes` lists them)")


def load_recipe(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Parse a recipe (a YAML path or a shipped recipe's name) into a Recipe, with the `--set`
    overrides applied; every error names the field (before any heavy work).

    Relative data paths written in the recipe (quantize.data, distill.data, profile.data,
    distill.quantized) are made absolute against the recipe file's folder; out_dir stays relative to
    the current directory. Short names of shipped data (alpaca-1000) and Hub ids stay as written.
    """
    path = recipe_path(recipe)
    recipe = from_dict(Recipe, apply_overrides(load_yaml(path), overrides))
    base = path.absolute().parent
    recipe.quantize.data = recipe.quantize.data.resolved(base)
    recipe.distill.data = recipe.distill.data.resolved(base)
    recipe.distill.more_data = [src.resolved(base) for src in recipe.distill.more_data]
    recipe.profile.data = recipe.profile.data.resolved(base)
    if recipe.distill.quantized:
        recipe.distill.quantized = resolve_path(recipe.distill.quantized, base)
    return recipe


def int_list(text: str | None, flag: str) -> list[int] | None:
    """'8,6' -> [8, 6] (None stays None); anything else a ConfigError naming `flag`."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag}: '{text}' is not a comma-separated list of integers, e.g. 8,6") from None
