"""Predicted time per token of a chain, under two cost models.

measured-curve model (`predict`): mirrors the runtime's schedule (runtime/chain.py, levels.py):
- the bottom level proposes k tokens per round: a model or EAGLE head runs k forwards, the first a
  catch-up over the tokens it has not fed yet (`_first_feed`), the rest M = 1; an n-gram proposer
  does one lookup (its curve at M = k) and may find nothing (draft_fill);
- a level i above it runs rounds: one forward over the draft D plus its last token (M = D + 1; a
  middle level feeds one more, M = D + 2, in the first round after the level above accepted its
  whole chunk) and keeps 1 + min(G, D) tokens, G geometric in the pair's per-token rate
  (Theorem 3.3); a middle level repeats rounds until it holds >= threshold_i tokens, hands them up
  as one chunk (distribution by a renewal recursion, expected rounds by Wald's identity);
- the target's rounds are the output; every verification also pays the pair's measured overhead.
Each forward is priced with the level's profiled curve T_i(M), interpolated.
A link whose drafter drafts token trees (PairProfile.tree_width > 1), or paths cut by a draft confidence, is priced
at M = draft size + 1 over its measured sizes and yields tokens per verification as its measured histogram (at the ks
it was profiled at only: the drafts' shape is measured, not modelled); a confidence-cut drafter runs as many forwards
as it drafted (a cut tree's drafter: its measured forwards per verification).

paper model (`predict_lemma`): Lemma 3.1 with constant T_i = T_i(1) (an n-gram proposal: T(k)), the
same per-link mean accepted lengths, alpha = k (1 for an n-gram proposer).
Both give ms per token and the speedup over the target's plain decode step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from polybasic.errors import ConfigError, check
from polybasic.planner.profile import CostCurve, LevelProfile, PairProfile, Profile
from polybasic.planner.theory import accepted_length_pmf, lemma_3_1, phi

Dist = dict[int, float]  # value -> probability


@dataclass(frozen=True)
class ChainConfig:
    """A candidate: level names (target first), the bottom's draft length, one threshold per middle level."""

    levels: tuple[str, ...]
    k: int
    thresholds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check(len(self.levels) >= 2, "levels", f"a chain needs >= 2 levels, got {list(self.levels)}",
              "give the target and at least one drafter")
        check(self.k >= 1, "k", f"must be >= 1, got {self.k}", "the bottom level proposes k tokens")
        check(len(self.thresholds) == len(self.levels) - 2, "thresholds",
              f"needs one per middle level ({len(self.levels) - 2}), got {list(self.thresholds)}", "fix the list")
        check(all(t >= 1 for t in self.thresholds), "thresholds", f"must be >= 1, got {list(self.thresholds)}",
              "a middle level hands up at least one token")

    @property
    def spec(self) -> str:
        """The levels below the target, as `--chain` spells them."""
        return "+".join(self.levels[1:])


@dataclass
class LevelLoad:
    name: str
    forwards_per_token: float
    mean_tokens_per_forward: float  # mean M
    ms_per_token: float


@dataclass
class Prediction:
    ms_per_token: float
    speedup: float  # baseline ms per token / ms_per_token
    tau: float  # tokens per target forward = E[L_1]
    mean_lengths: list[float]  # E[L_i] per link, target's first, at the planned sizes
    rounds_per_chunk: list[float]  # E[R_i] for each middle level
    levels: list[LevelLoad] = field(default_factory=list)
    prefill_ms: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def baseline_ms(profile: Profile) -> float:
    """Vanilla decoding of the target: its plain decode step (or T_1(1) when not measured)."""
    c = profile.level(profile.target).cost
    return c.decode_ms if c.decode_ms is not None else c.at(1)


def _pairs(profile: Profile, cfg: ChainConfig) -> list[PairProfile]:
    out = []
    for a, b in zip(cfg.levels, cfg.levels[1:]):
        p = profile.pair(a, b, cfg.k)
        if p is None:
            raise ConfigError(f"chain {cfg.spec}: the pair {a} <- {b} is not profiled; profile it or drop the chain")
        out.append(p)
    return out


def _normalised(histogram: dict[int, int]) -> Dist:
    """Counts -> probabilities."""
    total = sum(histogram.values())
    return {v: c / total for v, c in histogram.items()}


def _expect(dist: Dist, fn) -> float:
    return sum(p * fn(v) for v, p in dist.items())


def _mix(parts: list[tuple[float, Dist]]) -> Dist:
    out: Dist = {}
    for w, d in parts:
        for v, p in d.items():
            out[v] = out.get(v, 0.0) + w * p
    return out


def round_tokens(rate: float, drafts: Dist) -> Dist:
    """Tokens per verification round, 1 + min(G, D), for a draft length distribution D."""
    return _mix([(pd, {l: q for l, q in enumerate(accepted_length_pmf(rate, d), start=1)})
                 for d, pd in drafts.items()])


def chunk(tokens: Dist, threshold: int) -> tuple[Dist, float]:
    """Rounds yielding `tokens` each until the sum reaches threshold: (chunk length dist, E[rounds]).
    Every running sum s < threshold that is reached starts exactly one round (Wald: E[R] = sum)."""
    reach = [0.0] * threshold  # probability that the running sum ever equals s
    reach[0] = 1.0
    out: Dist = {}
    for s in range(threshold):
        for l, q in tokens.items():
            if s + l < threshold:
                reach[s + l] += reach[s] * q
            else:
                out[s + l] = out.get(s + l, 0.0) + reach[s] * q
    return out, sum(reach)


def _first_feed(kind: str, accepted: Dist, p_whole: float, after_hand_up: float, p_up: float) -> Dist:
    """M of the bottom level's first forward of a proposal (its catch-up). A head re-reads the rows
    its verifier just scored (accepted + 1). A model re-feeds its verifier's last token, plus its
    own last draft when the whole draft was accepted (p_whole); right after its verifier handed a
    chunk up (a fraction after_hand_up of proposals), also the token the level above added when it
    took the whole chunk (p_up), and nothing of its own otherwise (the rollback is shorter)."""
    if kind == "eagle":
        return {a + 1: p for a, p in accepted.items()}
    within = {2: p_whole, 1: 1 - p_whole}
    after = {3: p_up * p_whole, 2: p_up * (1 - p_whole), 1: 1 - p_up}
    return _mix([(1 - after_hand_up, within), (after_hand_up, after)])


def predict(profile: Profile, cfg: ChainConfig, new_tokens: int | None = None) -> Prediction:
    """The measured-curve model. new_tokens: amortise every level's prefill over that many tokens
    (the speedup then compares with vanilla's prefill + new_tokens decode steps); None: steady state."""
    pairs = _pairs(profile, cfg)
    lvs = [profile.level(n) for n in cfg.levels]
    n, k = len(lvs), cfg.k
    bottom = pairs[-1]
    drafts: Dist = {k: bottom.draft_fill, 0: 1 - bottom.draft_fill} if bottom.draft_fill < 1 else {k: 1.0}
    # bottom-up: draft length distribution seen by each verifier, its round tokens and chunks
    seen: list[Dist] = [{}] * (n - 1)  # D at verifier i
    per_round: list[Dist] = [{}] * (n - 1)  # L_i
    rounds = [1.0] * (n - 1)  # E[R_i] (1 for the target)
    for i in range(n - 2, -1, -1):
        seen[i] = drafts
        per_round[i] = round_tokens(pairs[i].rate, drafts)
        if pairs[i].shaped:  # a tree, or drafts cut by a confidence: measured tokens per verification and sizes
            check(cfg.k == pairs[i].k, "k", f"{cfg.k}: the pair {pairs[i].verifier} <- {pairs[i].drafter} was "
                  f"measured at k = {', '.join(map(str, profile.measured_ks(pairs[i].verifier, pairs[i].drafter)))} only",
                  "plan it at the ks it was profiled at (search.ks)")
            seen[i], per_round[i] = _normalised(pairs[i].sizes), _normalised(pairs[i].histogram)
        if i > 0:
            drafts, rounds[i] = chunk(per_round[i], cfg.thresholds[i - 1])
    p_whole = [_expect(seen[i], lambda d: pairs[i].rate ** d) for i in range(n - 1)]  # P(whole draft accepted)
    # top-down: rounds of each verifier per target round
    per_target = [1.0] * (n - 1)
    for i in range(1, n - 1):
        per_target[i] = per_target[i - 1] * rounds[i]
    loads: list[LevelLoad] = []
    total = 0.0
    tau = sum(l * p for l, p in per_round[0].items())
    for i in range(n - 1):
        c: CostCurve = lvs[i].cost
        ms = _expect(seen[i], lambda d: c.at(d + 1)) + pairs[i].overhead_ms
        mean_m = _expect(seen[i], lambda d: d + 1)
        ms_round = per_target[i] * ms
        if i > 0:  # catch-up: one more token in the first round after the level above took the whole chunk
            ms_round += per_target[i - 1] * p_whole[i - 1] * _expect(seen[i], lambda d: c.at(d + 2) - c.at(d + 1))
            mean_m += p_whole[i - 1] / rounds[i]
        loads.append(LevelLoad(lvs[i].name, per_target[i] / tau, mean_m, ms_round / tau))
        total += ms_round
    last, c = lvs[-1], lvs[-1].cost
    if last.kind == "ngram":  # one lookup of k tokens
        fwd, mean_m, ms_prop = 1, float(k), c.at(k)
    else:  # k forwards (drafts cut by a confidence: as many as drafted), the first a catch-up
        after = 1 / rounds[-1] if n > 2 else 0.0
        first = _first_feed(last.kind, {l - 1: p for l, p in per_round[-1].items()}, p_whole[-1], after,
                            p_whole[-2] if n > 2 else 0.0)
        # a draft of d > 0 tokens: d forwards, the first a catch-up; none for an empty one (the budget's last token)
        # (a cut tree's path: its measured forwards, which its size does not tell)
        fwd, drafting = (bottom.forwards if bottom.tree_width > 1 else _expect(seen[-1], float),
                         1 - seen[-1].get(0, 0.0)) if bottom.draft_confidence > 0 else (k, 1)
        mean_m = (drafting * _expect(first, float) + fwd - drafting) / fwd if fwd else 0.0
        ms_prop = drafting * _expect(first, c.at) + (fwd - drafting) * c.at(1)
    loads.append(LevelLoad(last.name, per_target[-1] * fwd / tau, mean_m, per_target[-1] * ms_prop / tau))
    total += per_target[-1] * ms_prop
    ms_token = total / tau
    prefill = sum(lv.cost.prefill_ms for lv in lvs)
    return Prediction(ms_token, _speedup(profile, ms_token, prefill, new_tokens), tau,
                      [sum(l * p for l, p in d.items()) for d in per_round], rounds[1:], loads, prefill)


def _speedup(profile: Profile, ms_token: float, prefill_ms: float, new_tokens: int | None) -> float:
    base = baseline_ms(profile)
    if new_tokens is None:
        return base / ms_token
    check(new_tokens >= 1, "new_tokens", f"must be >= 1, got {new_tokens}", "pass the generation length")
    target_prefill = profile.level(profile.target).cost.prefill_ms
    return (target_prefill + new_tokens * base) / (prefill_ms + new_tokens * ms_token)


def constant_times(lvs: Sequence[LevelProfile], k: int) -> tuple[list[float], float]:
    """The paper's constant T_i (T_i(1); an n-gram proposal T(k)) and alpha for a chain's levels."""
    times = [lv.cost.at(k if lv.kind == "ngram" else 1) for lv in lvs]
    return times, 1.0 if lvs[-1].kind == "ngram" else float(k)


def predict_lemma(profile: Profile, cfg: ChainConfig, mean_lengths: Sequence[float],
                  new_tokens: int | None = None) -> tuple[float, float]:
    """Lemma 3.1 with constant T_i: (ms per token, speedup), from per-link mean accepted lengths
    (e.g. Prediction.mean_lengths, so both models see the same acceptance)."""
    lvs = [profile.level(n) for n in cfg.levels]
    times, alpha = constant_times(lvs, cfg.k)
    ms_token = lemma_3_1(phi(1.0, mean_lengths, alpha), times)
    prefill = sum(lv.cost.prefill_ms for lv in lvs)
    return ms_token, _speedup(profile, ms_token, prefill, new_tokens)
