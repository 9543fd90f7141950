"""Recipe sections of the chain stages: profile -> plan -> export -> bench (plain dataclasses, no torch).

Candidate levels are written as chain-level spellings (see runtime.chainspec: `target@bfloat16`,
`ngram:3`, `PATH.safetensors`, `eagle:PATH`, `SOURCE@DTYPE`) plus names for what the recipe's
own stages wrote into its out_dir: `quantized` (<out_dir>/model.safetensors), `eagle:target` and
`eagle:quantized` (<out_dir>/distill/<drafter>/head.safetensors), and `quantized:SOURCE` for each
model of `quantize.siblings` (<out_dir>/siblings/SOURCE/model.safetensors).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from polybasic.data import DEFAULT_DATA, DataSource
from polybasic.errors import check

OWN_LEVELS = ("quantized", "eagle:target", "eagle:quantized")
SIBLING = "quantized:"  # `quantized:SOURCE`: the quantize stage's copy of the sibling model SOURCE


@dataclass
class ProfileSection:
    """What the profile stage measures: every candidate level's forward cost T_i(M) at `context`
    tokens of context, and every verifier <- drafter pair's acceptance at draft length `k` on the
    last `prompts` records of `data` (held out: they must not be among the distill stage's)."""

    levels: list[str] = field(default_factory=lambda: ["quantized", "eagle:target", "eagle:quantized", "ngram"])
    data: DataSource = field(default_factory=lambda: DataSource(DEFAULT_DATA))
    prompts: int = 8
    max_new_tokens: int = 64
    k: int = 5
    context: int = 256
    reps: int = 5
    temperature: float = 0.0  # the sampling the chain will run with (acceptance depends on it)
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prompts", "max_new_tokens", "k", "context", "reps"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, f"profile.{name}", f"must be an integer >= 1, got {v!r}",
                  "use a positive int")
        check(bool(self.levels), "profile.levels", "is empty", f"list candidate levels, e.g. {OWN_LEVELS}")
        check("spec_bench" not in self.data.path, "profile.data", "points at the Spec-Bench questions",
              "profile on held-out training prompts, never on the benchmark")
        from polybasic.runtime.sampling import SamplingConfig

        SamplingConfig(temperature=self.temperature, top_p=self.top_p)


@dataclass
class PlanSection:
    """The planner's search space (polybasic.planner.search.SearchSpace)."""

    k_values: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    thresholds: list[int] = field(default_factory=lambda: [2, 4, 6, 8, 10])
    max_levels: int = 4
    new_tokens: int = 128  # prefill is amortised over this many new tokens

    def __post_init__(self) -> None:
        self.space()  # validates: errors name the field

    def space(self):
        from polybasic.planner.search import SearchSpace

        return SearchSpace(list(self.k_values), list(self.thresholds), self.max_levels, self.new_tokens)


@dataclass
class ExportSection:
    folder: str = "bundle"  # inside out_dir


@dataclass
class BenchSection:
    """The bench stage: the bundle's chain beside vanilla on Spec-Bench questions."""

    questions: str = ""  # default: the bundled Spec-Bench file
    per_category: int = 1
    categories: list[str] = field(default_factory=list)  # empty: all
    max_new_tokens: int = 128
    methods: str = "vanilla,chain"
    warmup: int = 1

    def __post_init__(self) -> None:
        for name, low in (("per_category", 1), ("max_new_tokens", 1), ("warmup", 0)):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= low, f"bench.{name}", f"must be an integer >= {low}, got {v!r}",
                  f"use {low} or more")
