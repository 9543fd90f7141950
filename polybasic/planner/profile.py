"""Profile data: what the planner needs to know about each level and each verifier/drafter pair.

Written by the profile stage (polybasic.planner.measure) as JSON, read by the planner. Pure data, no
torch: a Profile can be edited by hand or built from another machine's numbers.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from polybasic.artifacts import write_json
from polybasic.config import from_dict
from polybasic.errors import ConfigError, check

PROFILE_VERSION = 1
COST_KINDS = ("model", "eagle", "ngram")


@dataclass
class CostCurve:
    """Median milliseconds of one forward of M tokens at a context of `context` tokens.

    model: ModelLevel.score (forward + the distributions of the M rows). eagle: one head forward of
    M rows + the distribution of its last row. ngram: one proposal of M tokens (a lookup).
    """

    tokens: list[int]  # M, increasing
    time_ms: list[float]  # [len(tokens)]
    context: int = 0
    prefill_tokens: int = 0
    prefill_ms: float = 0.0  # the whole prompt of prefill_tokens in one forward
    decode_ms: float | None = None  # a plain decode step (vanilla generation's), model levels only

    def __post_init__(self) -> None:
        check(len(self.tokens) >= 1 and len(self.tokens) == len(self.time_ms), "cost.tokens / cost.time_ms",
              f"need the same non-zero length, got {len(self.tokens)} and {len(self.time_ms)}",
              "give one time per token count")
        check(all(m >= 1 for m in self.tokens) and all(a < b for a, b in zip(self.tokens, self.tokens[1:])),
              "cost.tokens", f"must be increasing token counts >= 1, got {self.tokens}", "sort them, e.g. [1, 2, 4]")
        check(all(t >= 0 and math.isfinite(t) for t in self.time_ms), "cost.time_ms",
              f"must be finite times >= 0, got {self.time_ms}", "re-run the profile")

    def at(self, m: float) -> float:
        """T(M) interpolated linearly between measured points; below the first point its value;
        past the last, the last segment's slope continued (never decreasing)."""
        xs, ys = self.tokens, self.time_ms
        if m <= xs[0] or len(xs) == 1:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if m <= x1:
                return y0 + (y1 - y0) * (m - x0) / (x1 - x0)
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (m - xs[-1])


@dataclass
class LevelProfile:
    name: str  # the level's chain-spec spelling: "target", "target@bfloat16", "eagle:PATH", "ngram", ...
    kind: str  # model | eagle | ngram
    cost: CostCurve
    base: str | None = None  # eagle: the level whose features it was trained on

    def __post_init__(self) -> None:
        check(self.kind in COST_KINDS, f"levels[{self.name}].kind", f"unknown kind {self.kind!r}", f"use one of {COST_KINDS}")
        check((self.kind == "eagle") == (self.base is not None), f"levels[{self.name}].base",
              "is required for an eagle level and only for one", "name the level the head was trained on")


@dataclass
class PairProfile:
    """Acceptance of `drafter`'s proposals by `verifier` (a two-level chain) at draft length k."""

    verifier: str
    drafter: str
    k: int
    verifications: int
    mean_accepted_length: float  # tokens per verification (accepted drafts + 1), all verifications
    rate: float  # per-token acceptance rate (Theorem 3.3 inverted on full k-token drafts)
    draft_fill: float = 1.0  # mean draft length / k (an n-gram proposer often finds nothing)
    histogram: dict = field(default_factory=dict)  # accepted length -> verifications (int keys; str in JSON)
    overhead_ms: float = 0.0  # chain bookkeeping per verification outside the level forwards
    tree_width: int = 1  # > 1: the drafter drafts token trees of this many leaves (runtime.tree_verify)
    sizes: dict = field(default_factory=dict)  # tree pairs: tree size (nodes), confidence-cut pairs: draft length ->
    # verifications (int keys; str in JSON)
    by_rank: dict = field(default_factory=dict)  # tree pairs: "depth:rank" -> [accepted, tried] (LinkStats.by_rank)
    draft_confidence: float = 0.0  # > 0: drafts (a tree's path) cut after a token the drafter gave less
    # (Chain.draft_confidence); their lengths are measured (sizes) like a tree's shape, and planned at the ks measured
    forwards: float = 0.0  # the drafter's forwards per verification, measured (0: not measured; k for full drafts)

    def __post_init__(self) -> None:
        where = f"pairs[{self.verifier}<-{self.drafter}]"
        check(self.k >= 1, f"{where}.k", f"must be >= 1, got {self.k}", "pass the draft length profiled")
        check(0 <= self.rate <= 1, f"{where}.rate", f"must be in [0, 1], got {self.rate}", "re-run the profile")
        check(0 <= self.draft_fill <= 1, f"{where}.draft_fill", f"must be in [0, 1], got {self.draft_fill}",
              "mean draft length / k")
        check(0 <= self.draft_confidence < 1, f"{where}.draft_confidence", f"must be in [0, 1), got "
              f"{self.draft_confidence}", "the confidence the drafts were measured with (0: full drafts)")
        check(self.tree_width == 1 or self.draft_confidence == 0 or self.forwards > 0, f"{where}.forwards",
              "a tree pair measured with a draft confidence needs its drafter's forwards per verification (its "
              "trees' sizes do not tell them)", "re-run the profile")
        check(not self.shaped or (self.histogram and self.sizes), f"{where}.histogram",
              "a tree pair or one with a draft confidence needs its measured histogram and draft sizes",
              "re-run the profile")
        self.histogram = {int(a): int(n) for a, n in self.histogram.items()}  # JSON keys are strings
        self.sizes = {int(a): int(n) for a, n in self.sizes.items()}

    @property
    def shaped(self) -> bool:
        """Whether the drafts' shape is measured, not modelled: token trees, or paths cut by a draft confidence."""
        return self.tree_width > 1 or self.draft_confidence > 0

    @property
    def nodes(self) -> float:
        """A tree pair's mean tree size (0 for a path pair)."""
        total = sum(self.sizes.values())
        return sum(s * n for s, n in self.sizes.items()) / total if total else 0.0


@dataclass
class Profile:
    target: str
    levels: list[LevelProfile]
    pairs: list[PairProfile]
    device: str = "cpu"
    sampling: dict = field(default_factory=dict)  # temperature, top_k, top_p the pairs were measured at
    compiled: bool = False  # the levels ran compiled steps (runtime.compiled): the baseline is compiled plain decoding
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        check(self.version == PROFILE_VERSION, "version", f"is {self.version}, this planner reads {PROFILE_VERSION}",
              "re-run the profile stage")
        names = [lv.name for lv in self.levels]
        check(len(set(names)) == len(names), "levels", f"names repeat: {names}", "give each level one entry")
        check(self.target in names, "target", f"{self.target!r} is not among the levels {names}",
              "profile the target's cost curve too")
        check(self.level(self.target).kind == "model", "target", "must be a model level", "put a model on top")
        for p in self.pairs:
            for role in ("verifier", "drafter"):
                check(getattr(p, role) in names, f"pairs[{p.verifier}<-{p.drafter}].{role}",
                      "is not a profiled level", f"use one of {names}")
            check(self.level(p.verifier).kind == "model", f"pairs[{p.verifier}<-{p.drafter}].verifier",
                  "must be a model level (only models verify)", "swap the pair")
        keys = [(p.verifier, p.drafter, p.k) for p in self.pairs]
        check(len(set(keys)) == len(keys), "pairs", f"repeat a (verifier, drafter, k): {keys}",
              "keep one measurement per pair and draft length")

    def level(self, name: str) -> LevelProfile:
        for lv in self.levels:
            if lv.name == name:
                return lv
        raise ConfigError(f"level {name!r}: not in the profile; profiled levels: {[lv.name for lv in self.levels]}")

    def pair(self, verifier: str, drafter: str, k: int | None = None) -> PairProfile | None:
        """The pair's profile: measured at draft length k where it was (a tree drafter's, measured per k), else its
        first (a path pair's rate carries to any k)."""
        found = [p for p in self.pairs if p.verifier == verifier and p.drafter == drafter]
        return next((p for p in found if p.k == k), found[0] if found else None)

    def measured_ks(self, verifier: str, drafter: str) -> list[int]:
        """The draft lengths a pair whose drafts' shape is measured (PairProfile.shaped) was profiled at (none for a
        pair of full path drafts: its rate carries to any k)."""
        return sorted(p.k for p in self.pairs if p.verifier == verifier and p.drafter == drafter and p.shaped)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> Profile:
        return from_dict(cls, data, where)

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"profile: {p} does not exist; run the profile stage first")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"profile: {p} is not valid JSON ({e}); re-run the profile stage") from None
        return cls.from_dict(data, str(p))
