"""The measured-curve model: hand-computed chains, and the schedule it assumes checked against the
runtime's own counters on scripted models whose acceptance is i.i.d. (the model's premise)."""
import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError
from polybasic.planner.cost import ChainConfig, chunk, predict, predict_lemma, round_tokens
from polybasic.planner.profile import CostCurve, LevelProfile, PairProfile, Profile
from polybasic.planner.search import plan
from polybasic.planner.theory import lemma_3_1, phi
from polybasic.runtime.chain import Chain
from polybasic.runtime.levels import ModelLevel
from tests.helpers import ScriptedLM


def curve(times, decode_ms=None, prefill_ms=0.0):
    return CostCurve(tokens=list(range(1, len(times) + 1)), time_ms=list(times), context=64,
                     prefill_tokens=64, prefill_ms=prefill_ms, decode_ms=decode_ms)


def pair(v, d, rate, k=4, fill=1.0, overhead=0.0):
    return PairProfile(v, d, k=k, verifications=100, mean_accepted_length=1.0, rate=rate, draft_fill=fill,
                       overhead_ms=overhead)


def test_two_levels_hand_computed():
    prof = Profile("t", [LevelProfile("t", "model", curve([10, 12, 14, 16], decode_ms=10)),
                         LevelProfile("d", "model", curve([1, 1.5]))], [pair("t", "d", 0.5)])
    pred = predict(prof, ChainConfig(("t", "d"), k=2))
    # k = 2: tokens per round 1, 2, 3 with probability .5, .25, .25 -> tau 1.75. The target verifies
    # M = 3 (14 ms). The drafter's first forward re-feeds its last draft when both were accepted
    # (M = 2 with p .25: 1.5 ms, else 1 ms), then one M = 1 forward: 1.125 + 1 ms.
    tau = 0.5 * 1 + 0.25 * 2 + 0.25 * 3
    per_round = 14 + (0.25 * 1.5 + 0.75 * 1) + 1
    assert pred.tau == pytest.approx(tau, rel=1e-12)
    assert pred.ms_per_token == pytest.approx(per_round / tau, rel=1e-12)
    assert pred.speedup == pytest.approx(10 / (per_round / tau), rel=1e-12)
    assert [lv.forwards_per_token for lv in pred.levels] == pytest.approx([1 / tau, 2 / tau], rel=1e-12)
    assert [lv.mean_tokens_per_forward for lv in pred.levels] == pytest.approx([3, (1.25 + 1) / 2], rel=1e-12)
    # the paper's model on the same acceptance: phi = [1/tau, k/tau], constant T_i(1)
    ms, sp = predict_lemma(prof, ChainConfig(("t", "d"), k=2), pred.mean_lengths)
    assert ms == pytest.approx(10 / tau + 2 * 1 / tau, rel=1e-12) and sp == pytest.approx(10 / ms, rel=1e-12)


def test_three_levels_hand_computed():
    prof = Profile("t", [LevelProfile("t", "model", curve([10, 12, 14, 16, 18])),
                         LevelProfile("m", "model", curve([4, 5, 6, 7])),
                         LevelProfile("ng", "ngram", curve([0.2, 0.3]))],
                   [pair("t", "m", 0.5), pair("m", "ng", 0.5)])
    cfg = ChainConfig(("t", "m", "ng"), k=1, thresholds=(2,))
    pred = predict(prof, cfg)
    # m verifies 1-token drafts (M = 2, 5 ms) yielding 1 or 2 tokens (p .5 each) until it holds >= 2:
    # chunks of 2 (p .5 + .25) or 3 (p .25), E[rounds] = 1 + .5.
    assert pred.rounds_per_chunk == pytest.approx([1.5], rel=1e-12)
    c2, c3 = 0.75, 0.25
    # the target verifies a chunk C (M = C + 1) at rate .5: tokens 1..C+1
    p_tok = {1: 0.5, 2: 0.25, 3: c2 * 0.25 + c3 * 0.125, 4: c3 * 0.125}
    tau = sum(l * p for l, p in p_tok.items())
    target = c2 * 14 + c3 * 16
    middle = 1.5 * 5 + (c2 * 0.25 + c3 * 0.125) * (6 - 5)  # + one more token after a whole chunk was taken
    ngram = 1.5 * 0.2  # one lookup of k = 1 token per middle round
    assert pred.tau == pytest.approx(tau, rel=1e-12)
    assert pred.ms_per_token == pytest.approx((target + middle + ngram) / tau, rel=1e-12)
    assert pred.mean_lengths == pytest.approx([tau, 1.5], rel=1e-12)
    ms, _ = predict_lemma(prof, cfg, pred.mean_lengths)
    assert ms == pytest.approx(lemma_3_1(phi(1, [tau, 1.5], 1.0), [10, 4, 0.2]), rel=1e-12)  # an n-gram proposal: T(k)


def test_empty_ngram_proposals_cost_a_round():
    prof = Profile("t", [LevelProfile("t", "model", curve([10, 12, 14])), LevelProfile("ng", "ngram", curve([1, 1]))],
                   [pair("t", "ng", 1.0, fill=0.5)])
    pred = predict(prof, ChainConfig(("t", "ng"), k=2))
    # half the lookups find nothing (M = 1, one token), half propose 2 always-accepted tokens (M = 3, 3 tokens)
    assert pred.tau == pytest.approx(2.0, rel=1e-12)
    assert pred.ms_per_token == pytest.approx((0.5 * 10 + 0.5 * 14 + 1) / 2, rel=1e-12)


def test_chunk_wald_identity():
    tokens = round_tokens(0.8, {4: 1.0})
    dist, rounds = chunk(tokens, 6)
    assert sum(dist.values()) == pytest.approx(1.0, rel=1e-12) and min(dist) == 6 and max(dist) <= 6 + 4
    mean = lambda d: sum(v * p for v, p in d.items())  # noqa: E731
    assert mean(dist) == pytest.approx(rounds * mean(tokens), rel=1e-12)


def test_prefill_amortised():
    prof = Profile("t", [LevelProfile("t", "model", curve([10, 12, 14], decode_ms=10, prefill_ms=50)),
                         LevelProfile("d", "model", curve([1, 1], prefill_ms=5))], [pair("t", "d", 1.0)])
    cfg = ChainConfig(("t", "d"), k=2)
    steady = predict(prof, cfg)
    amortised = predict(prof, cfg, new_tokens=100)
    assert amortised.speedup == pytest.approx((50 + 100 * 10) / (55 + 100 * steady.ms_per_token), rel=1e-12)


# -- the schedule against the runtime ------------------------------------------------------------
V = 6


def constant_lm(logits):
    """A context-independent distribution: acceptance against another one is i.i.d. per token."""
    return ScriptedLM(V, lambda ctx: torch.tensor(logits))


def overlap(a, b):
    pa, pb = torch.softmax(torch.tensor(a), -1), torch.softmax(torch.tensor(b), -1)
    return float(torch.minimum(pa, pb).sum())  # per-token acceptance probability of speculative sampling


@pytest.mark.parametrize("k,thresholds", [(3, ()), (2, (4,))])
def test_schedule_matches_runtime_counters(k, thresholds):
    """Forwards per token and tokens per forward of every level, predicted from the per-pair rates,
    against the runtime's counters over 2500 sampled tokens. Tolerance 5%: sampling noise of the
    counts (a few hundred verifications each) is about 2%."""
    dists = [[1.0, 0.5, 0.0, 0.2, -0.5, 0.3], [0.8, 0.6, 0.1, 0.0, -0.3, 0.2], [1.2, 0.2, 0.3, 0.0, 0.0, 0.0]]
    n = len(thresholds) + 2
    names = [f"l{i}" for i in range(n)]
    levels = [ModelLevel(constant_lm(d), name) for d, name in zip(dists, names)]
    chain = Chain(levels, k=k, thresholds=list(thresholds))
    tokens, st = chain.generate([2], 2500, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    flat = curve([1.0] * 12)
    prof = Profile(names[0], [LevelProfile(name, "model", flat) for name in names],
                   [pair(a, b, overlap(dists[i], dists[i + 1])) for i, (a, b) in enumerate(zip(names, names[1:]))])
    pred = predict(prof, ChainConfig(tuple(names), k, thresholds))
    assert st.tau == pytest.approx(pred.tau, rel=0.05)
    for got, want in zip(st.levels, pred.levels):
        fwd = got["forwards"] - (1 if got["name"] != names[0] else 0)  # the drafters' prompt prefill
        assert fwd / len(tokens) == pytest.approx(want.forwards_per_token, rel=0.05), got["name"]
        assert (got["tokens_fed"] - 1) / got["forwards"] == pytest.approx(want.mean_tokens_per_forward, rel=0.05)


def test_a_tree_link_is_priced_at_its_size_with_its_measured_lengths():
    tree = PairProfile("t", "ng/3", k=2, verifications=100, mean_accepted_length=1.7, rate=0.3,
                       histogram={1: 50, 2: 30, 3: 20}, tree_width=3, sizes={3: 1, 6: 1}, by_rank={"0:0": [40, 100]})
    prof = Profile("t", [LevelProfile("t", "model", curve([10, 12, 14, 16, 18, 20, 22], decode_ms=10)),
                         LevelProfile("ng/3", "ngram", curve([1, 1]))], [tree])
    pred = predict(prof, ChainConfig(("t", "ng/3"), k=2))
    # tokens per verification as measured (tau 1.7); the target scores 3 or 6 nodes + 1 row: (T(4) + T(7)) / 2
    assert pred.tau == pytest.approx(1.7, rel=1e-12) and tree.nodes == 4.5
    assert pred.ms_per_token == pytest.approx(((16 + 22) / 2 + 1) / 1.7, rel=1e-12)
    with pytest.raises(ConfigError, match="measured at k = 2"):
        predict(prof, ChainConfig(("t", "ng/3"), k=3))
    assert [r.k for r in plan(prof).rows] == [2]  # trees are planned at their profiled k only
    assert Profile.from_dict(prof.to_dict()).pairs[0] == tree


def test_a_tree_profiled_at_two_ks_is_planned_at_both_and_keeps_the_faster():
    def tree(k, hist, sizes):
        return PairProfile("t", "ng/2", k=k, verifications=100, mean_accepted_length=1.0, rate=0.3, histogram=hist,
                           tree_width=2, sizes=sizes)

    t2, t3 = tree(2, {1: 50, 2: 30, 3: 20}, {4: 1}), tree(3, {1: 40, 2: 30, 3: 20, 4: 10}, {6: 1})
    flat_then_steep = curve([10, 10, 10, 10, 10, 20, 30], decode_ms=10)  # 5 rows cost as 1, 6 rows twice as much
    prof = Profile("t", [LevelProfile("t", "model", flat_then_steep), LevelProfile("ng/2", "ngram", curve([1, 1]))],
                   [t3, t2])
    assert prof.pair("t", "ng/2", 2) is t2 and prof.pair("t", "ng/2", 3) is t3 and prof.measured_ks("t", "ng/2") == [2, 3]
    # k 2: tau 1.7 for T(5) + 1; k 3: tau 2.0 for T(7) + 1
    assert predict(prof, ChainConfig(("t", "ng/2"), k=2)).ms_per_token == pytest.approx(11 / 1.7, rel=1e-12)
    assert predict(prof, ChainConfig(("t", "ng/2"), k=3)).ms_per_token == pytest.approx(31 / 2.0, rel=1e-12)
    best = plan(prof).best
    assert best.k == 2 and best.tau == pytest.approx(1.7)
    with pytest.raises(ConfigError, match="measured at k = 2, 3 only"):
        predict(prof, ChainConfig(("t", "ng/2"), k=4))
    with pytest.raises(ConfigError, match="repeat a"):
        Profile("t", prof.levels, [t2, t2])
