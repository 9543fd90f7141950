"""Enumerate candidate chains from a profile, predict each under both cost models, rank, report.

A candidate is an ordered subset of the profiled levels with the target on top, in which every
adjacent pair was profiled, an n-gram proposer sits only at the bottom and an EAGLE head only right
below the level it was trained on. For each, every k and every threshold tuple of the search space
is predicted with the measured-curve model; the candidate's row keeps its best configuration, with
the paper's Lemma 3.1 prediction beside it and Theorem 3.2's verdicts for every inserted level.
The ranking uses the measured-curve model. Of Theorem 3.2's forms, the exact one is the verdict
(an "if and only if" under Lemma 3.1, computable from measured numbers: the ceiling is known and
the drafter's saving is kept); the paper's bound, a sufficient condition, is shown beside it.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path

from polybasic.artifacts import write_json
from polybasic.config import check_search_space
from polybasic.planner.cost import (
    ChainConfig,
    LevelLoad,
    Prediction,
    baseline_ms,
    constant_times,
    predict,
    predict_lemma,
)
from polybasic.planner.profile import Profile
from polybasic.planner.theory import Insertion, Verdict, theorem_3_2


@dataclass
class SearchSpace:
    k_values: list[int] = field(default_factory=lambda: list(range(1, 9)))
    thresholds: list[int] = field(default_factory=lambda: list(range(1, 13)))  # per middle level
    max_levels: int = 4
    new_tokens: int | None = None  # amortise prefill over this many tokens; None: steady state

    def __post_init__(self) -> None:
        check_search_space(self.k_values, self.thresholds, self.max_levels)


@dataclass
class InsertionVerdicts:
    """Theorem 3.2 for one inserted (middle) level: both forms, or why it does not apply."""

    level: str
    exact: Verdict | None = None
    paper: Verdict | None = None
    note: str = ""


@dataclass
class Row:
    chain: list[str]  # target first
    k: int
    thresholds: list[int]
    ms_per_token: float  # measured-curve model
    speedup: float
    ms_per_token_lemma: float  # Lemma 3.1, constant T_i
    speedup_lemma: float
    tau: float
    mean_lengths: list[float]
    verdicts: list[InsertionVerdicts] = field(default_factory=list)
    loads: list[LevelLoad] = field(default_factory=list)  # per level: forwards per token, mean M, ms per token

    @property
    def spec(self) -> str:
        return "+".join(self.chain[1:])


@dataclass
class Plan:
    target: str
    baseline_ms: float
    rows: list[Row]  # best first

    @property
    def best(self) -> Row:
        return self.rows[0]

    def to_dict(self) -> dict:
        d = asdict(self)
        for row, r in zip(self.rows, d["rows"]):
            r["spec"] = row.spec
        return d

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict(), indent=1)


def candidate_chains(profile: Profile, max_levels: int = 4) -> list[tuple[str, ...]]:
    """Every ordered subset of the levels below the target that a chain can run (see module doc)."""
    others = [lv.name for lv in profile.levels if lv.name != profile.target]
    out = []
    for r in range(1, max_levels):
        for below in itertools.permutations(others, r):
            chain = (profile.target, *below)
            if chain_problem(profile, chain) is None:
                out.append(chain)
    return out


def chain_problem(profile: Profile, chain: tuple[str, ...]) -> str | None:
    """Why a chain cannot run or cannot be predicted, or None."""
    for i, name in enumerate(chain):
        lv = profile.level(name)
        if lv.kind == "ngram" and i != len(chain) - 1:
            return f"{name}: an n-gram proposer only proposes; it must be the bottom level"
        if lv.kind == "eagle" and (i == 0 or chain[i - 1] != lv.base or i != len(chain) - 1):
            return f"{name}: an EAGLE head drafts only at the bottom, right below {lv.base}"
        if i and profile.pair(chain[i - 1], name) is None:
            return f"the pair {chain[i - 1]} <- {name} is not profiled"
        if 0 < i < len(chain) - 1 and profile.pair(chain[i - 1], name).shaped:
            return (f"{name}: its drafts' shape was measured as the bottom level's (a token tree, or cut by a draft "
                    "confidence); a middle level's chunks are not")
    return None


def plan(profile: Profile, space: SearchSpace = SearchSpace()) -> Plan:
    """Rank every candidate chain by its best measured-curve prediction."""
    rows = []
    for chain in candidate_chains(profile, space.max_levels):
        best: tuple[ChainConfig, Prediction] | None = None
        for k in ks(profile, chain, space):
            for ts in itertools.product(space.thresholds, repeat=len(chain) - 2):
                cfg = ChainConfig(chain, k, ts)
                pred = predict(profile, cfg, space.new_tokens)
                if best is None or pred.speedup > best[1].speedup:  # prefill amortised over new_tokens
                    best = (cfg, pred)
        rows.append(_row(profile, *best, space.new_tokens))
    rows.sort(key=lambda r: -r.speedup)  # not ms_per_token: a level's slow prefill counts too
    return Plan(profile.target, baseline_ms(profile), rows)


def ks(profile: Profile, chain: tuple[str, ...], space: SearchSpace) -> list[int]:
    """The draft lengths to try for a chain: the search space's, or where the bottom's drafts have a measured shape
    (token trees, drafts cut by a confidence) the ks they were profiled at (measured per shape, not modelled)."""
    return profile.measured_ks(chain[-2], chain[-1]) or list(space.k_values)


def _row(profile: Profile, cfg: ChainConfig, pred: Prediction, new_tokens: int | None) -> Row:
    ms_l, sp_l = predict_lemma(profile, cfg, pred.mean_lengths, new_tokens)
    verdicts = [insertion_verdicts(profile, cfg, pred, i) for i in range(1, len(cfg.levels) - 1)]
    return Row(list(cfg.levels), cfg.k, list(cfg.thresholds), pred.ms_per_token, pred.speedup, ms_l, sp_l,
               pred.tau, pred.mean_lengths, verdicts, pred.levels)


def insertion_verdicts(profile: Profile, cfg: ChainConfig, pred: Prediction, i: int) -> InsertionVerdicts:
    """Theorem 3.2 for middle level i of cfg against the same chain without it (same k, thresholds),
    with constant T_i and the mean accepted lengths both chains are predicted to reach."""
    name = cfg.levels[i]
    without = cfg.levels[:i] + cfg.levels[i + 1:]
    why = chain_problem(profile, without)
    if why is not None:
        return InsertionVerdicts(name, note=f"no two-level reference: {why}")
    ref = predict(profile, ChainConfig(without, cfg.k, cfg.thresholds[:i - 1] + cfg.thresholds[i:]))
    lvs = [profile.level(n) for n in cfg.levels]
    times, alpha = constant_times(lvs, cfg.k)
    if i + 1 < len(cfg.levels) - 1:  # the level below is itself a middle level: its rounds per chunk
        alpha = pred.rounds_per_chunk[i]
    x = Insertion(t1=times[i - 1], el1=ref.mean_lengths[i - 1], t2=times[i + 1], t2_new=times[i],
                  el1_new=pred.mean_lengths[i - 1], el2_new=pred.mean_lengths[i], alpha=alpha)
    return InsertionVerdicts(name, theorem_3_2(x, "exact"), theorem_3_2(x, "paper"))


def _verdict_cell(vs: list[InsertionVerdicts], form: str) -> str:
    cells = []
    for v in vs:
        verdict: Verdict | None = getattr(v, form)
        if verdict is None:
            cells.append(f"{v.level}: n/a ({v.note})")
        else:
            sign = "<" if verdict.pays else ">="
            cells.append(f"{v.level}: {'pays' if verdict.pays else 'slower'} "
                         f"({verdict.lhs:.3f} {sign} {verdict.rhs:.3f})")
    return "; ".join(cells) or "-"


def render_markdown(p: Plan) -> str:
    """One row per candidate chain: predicted speedups under both models and Theorem 3.2's verdicts."""
    lines = [f"Target `{p.target}`, vanilla decode step {p.baseline_ms:.2f} ms. Speedups are predictions: "
             "measured-curve model (T_i(M) at the planned sizes) and Lemma 3.1 (constant T_i). "
             "Theorem 3.2 for each inserted level: T2'/T1 against the right-hand side, exact form "
             "(ceil(E[L1]'/E[L2]'), drafter term) and the paper's bound (factor 2).", "",
             "| # | chain | k | thresholds | tau | speedup (curve) | speedup (Lemma 3.1) "
             "| Thm 3.2 exact | Thm 3.2 paper |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, r in enumerate(p.rows, 1):
        spec = r.spec.replace("|", "\\|")  # a chain's 'LEVEL|ngram' inside a cell
        lines.append(f"| {n} | `{spec}` | {r.k} | {','.join(map(str, r.thresholds)) or '-'} | {r.tau:.2f} "
                     f"| {r.speedup:.2f}x | {r.speedup_lemma:.2f}x | {_verdict_cell(r.verdicts, 'exact')} "
                     f"| {_verdict_cell(r.verdicts, 'paper')} |")
    return "\n".join(lines) + "\n"
