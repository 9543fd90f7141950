"""Profiling on tiny models: what is timed has the right shape, acceptance statistics are consistent
(identical drafter: everything accepted; scripted disagreement: nothing). No timing is asserted."""
from dataclasses import asdict

import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, EagleHead
from polybasic.planner.cost import ChainConfig, predict
from polybasic.planner.measure import build_profile, cost_curve, level_profile, medians_ms, pair_acceptance
from polybasic.planner.profile import PairProfile, Profile
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import ScriptedLM, lean_from_hf, one_hot_logits, perturbed_copy, tiny_hf_llama

V = 16


class RecordingLM(ScriptedLM):
    """Scripted stub that records how many tokens each forward is fed."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.widths = []

    def __call__(self, tokens, start, **kw):
        self.widths.append((tokens.shape[1], start))
        return super().__call__(tokens, start, **kw)


def test_cost_curve_feeds_m_tokens_at_the_context():
    lm = RecordingLM(V, lambda ctx: one_hot_logits(V, 3))
    c = cost_curve(ModelLevel(lm, "m"), tokens=[1, 3, 5], context=12, reps=2, warmup=1)
    assert c.tokens == [1, 3, 5] and len(c.time_ms) == 3 and c.context == 12 == c.prefill_tokens
    assert c.decode_ms is not None and c.prefill_ms > 0 and all(t > 0 for t in c.time_ms)
    # round-robin, 3 times: a prefill of 12 tokens from 0, a decode step, forwards of M = 1, 3, 5 at 12
    assert lm.widths == [(12, 0), (1, 12), (1, 12), (3, 12), (5, 12)] * 3


def test_cost_curve_of_each_kind():
    hf = tiny_hf_llama(seed=3, vocab=64)
    target = ModelLevel(lean_from_hf(hf), "target")
    torch.manual_seed(0)
    head = EagleHead(DrafterConfig.for_base(target.model.args)).bind(target.model).eval().requires_grad_(False)
    eagle = EagleLevel(head, target, name="eagle:h")
    for lv, decode in ((target, True), (eagle, False), (NGramLevel(name="ngram", vocab_size=64), False)):
        c = cost_curve(lv, tokens=range(1, 4), context=24, reps=2, warmup=1)
        assert c.tokens == [1, 2, 3] and len(c.time_ms) == 3 and (c.decode_ms is not None) == decode
    assert level_profile(eagle, c).base == "target" and level_profile(eagle, c).kind == "eagle"
    assert cost_curve(target.model, tokens=[2], context=8, reps=1, warmup=0).tokens == [2]  # a bare model
    with pytest.raises(ConfigError, match="context"):
        cost_curve(target, tokens=[1, 2], context=400)


def test_identical_drafter_accepts_everything():
    hf = tiny_hf_llama(seed=3, vocab=64, init_std=0.2)
    verifier, drafter = ModelLevel(lean_from_hf(hf), "v"), ModelLevel(lean_from_hf(hf), "d")
    k = 4
    # the drafter has the verifier's cache layout: it takes the prompt's K/V and the verifier commits
    # the first token from its prefill (not counted as a verification), then 3 full drafts
    pair = pair_acceptance(verifier, drafter, [[5, 6, 7], [9, 2]], k, max_new_tokens=3 * (k + 1) + 1)
    assert pair.mean_accepted_length == k + 1 and pair.rate == 1.0 and pair.draft_fill == 1.0
    assert pair.histogram == {k + 1: 6} and pair.verifications == 6 and pair.overhead_ms >= 0


def test_scripted_never_accept():
    verifier = ModelLevel(ScriptedLM(V, lambda ctx: one_hot_logits(V, 3)), "v")
    drafter = ModelLevel(ScriptedLM(V, lambda ctx: one_hot_logits(V, 4)), "d")
    pair = pair_acceptance(verifier, drafter, [[2]], 3, max_new_tokens=10)
    assert pair.mean_accepted_length == 1.0 and pair.rate == 0.0 and pair.histogram == {1: 10}


def test_sampled_acceptance_and_profile_round_trip(tmp_path):
    hf = tiny_hf_llama(seed=3, vocab=64, init_std=0.2)
    target = ModelLevel(lean_from_hf(hf), "target")
    near = ModelLevel(lean_from_hf(perturbed_copy(hf, 0.3)), "near")
    ngram = NGramLevel(name="ngram")
    prompts = [[5, 6, 7, 5, 6], [9, 2, 9, 2]]
    prof = build_profile([target, near, ngram], [(target, near), (near, ngram), (target, ngram)],
                         prompts, k=3, sampling=SamplingConfig(temperature=1.0), context=16, reps=2,
                         max_new_tokens=24)
    for p in prof.pairs:
        assert sum(p.histogram.values()) == p.verifications
        assert p.mean_accepted_length == pytest.approx(
            sum(length * n for length, n in p.histogram.items()) / p.verifications, rel=1e-12)
        assert 0 <= p.rate <= 1 and 1 <= p.mean_accepted_length <= 4
    assert prof.level("target").cost.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 12]  # every M a tree of k 3 scores
    assert prof.pair("target", "near").draft_fill == 1.0  # a model always drafts k tokens
    assert 0 <= prof.pair("near", "ngram").draft_fill <= 1
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    assert predict(prof, ChainConfig(("target", "near", "ngram"), 3, (4,))).ms_per_token > 0


def test_medians_ms_round_robin():
    order = []
    out = medians_ms([lambda: order.append("a"), lambda: order.append("b")], reps=2, warmup=1)
    assert order == ["a", "b"] * 3 and len(out) == 2 and all(t >= 0 for t in out)
    with pytest.raises(ConfigError, match="reps"):
        medians_ms([lambda: None], reps=0)


def test_a_confidence_cut_pair_records_its_draft_lengths_and_the_plan_prices_them():
    hf = tiny_hf_llama(seed=3, vocab=64, init_std=0.2)
    target = ModelLevel(lean_from_hf(hf), "target")
    near = ModelLevel(lean_from_hf(perturbed_copy(hf, 0.3)), "near")
    prompts = [[5, 6, 7, 5, 6], [9, 2, 9, 2]]
    full = pair_acceptance(target, near, prompts, 4, max_new_tokens=24)
    cut = pair_acceptance(target, near, prompts, 4, max_new_tokens=24, draft_confidence=0.9)
    assert full.sizes == {} and full.draft_confidence == 0 and not full.shaped
    lengths = cut.sizes
    assert cut.shaped and cut.draft_confidence == 0.9 and sum(lengths.values()) == cut.verifications
    assert any(0 < d < 4 for d in lengths) and max(lengths) <= 4  # a tiny random model is unsure: some end early
    curves = [level_profile(lv, cost_curve(lv, range(1, 6), 16, reps=1)) for lv in (target, near)]
    prof = Profile("target", curves, [cut])
    pred = predict(prof, ChainConfig(("target", "near"), 4))
    assert pred.tau == pytest.approx(cut.mean_accepted_length)
    drafted = sum(d * n for d, n in lengths.items()) / cut.verifications
    assert pred.levels[1].forwards_per_token == pytest.approx(drafted / pred.tau)  # as many forwards as drafted
    with pytest.raises(ConfigError, match="measured at k = 4 only"):
        predict(prof, ChainConfig(("target", "near"), 3))


def test_a_cut_tree_pair_records_its_drafters_forwards_and_the_plan_prices_them():
    """A tree whose path a draft confidence cuts: its size counts the siblings too, so the pair records the drafter's
    forwards per verification, and the plan prices those (not the tree's size, not k)."""
    hf = tiny_hf_llama(seed=3, vocab=64, init_std=0.2)
    target = ModelLevel(lean_from_hf(hf), "target")
    near = ModelLevel(lean_from_hf(perturbed_copy(hf, 0.3)), "near", tree_width=2)
    cut = pair_acceptance(target, near, [[5, 6, 7, 5, 6], [9, 2, 9, 2]], 4, max_new_tokens=24, draft_confidence=0.9)
    assert cut.shaped and cut.tree_width == 2 and cut.draft_confidence == 0.9
    nodes = sum(d * n for d, n in cut.sizes.items()) / cut.verifications
    assert 0 < cut.forwards < nodes and cut.forwards < 4  # paths cut short; siblings cost no forward
    curves = [level_profile(lv, cost_curve(lv, range(1, 10), 16, reps=1)) for lv in (target, near)]
    pred = predict(Profile("target", curves, [cut]), ChainConfig(("target", "near"), 4))
    assert pred.levels[1].forwards_per_token == pytest.approx(cut.forwards / pred.tau)
    without = {f: v for f, v in asdict(cut).items() if f != "forwards"}
    with pytest.raises(ConfigError, match=r"forwards: a tree pair measured with a draft confidence"):
        PairProfile(**without)  # would be priced at no drafter forward
    old = {**without, "tree_width": 1, "draft_confidence": 0.0}  # a pair a profile written before the field holds
    assert PairProfile(**old).forwards == 0.0
