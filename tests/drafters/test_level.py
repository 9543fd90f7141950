"""EagleLevel in a chain is lossless: greedy output equals the target's own; sampled output follows
the target's distribution (chi-square, same method and bound as tests/runtime/test_chain_distribution.py)."""
import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.models.eagle_head import DrafterConfig, EagleHead
from polybasic.runtime.chain import Chain
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from tests.helpers import lean_from_hf, perturbed_copy, tiny_hf_llama
from tests.runtime.test_chain_distribution import KW, P_MIN, PROMPT, N, V, exact_joint
from tests.stat_utils import chain_sample_counts, chi_square_pvalue


def make_head(model, seed=0):
    torch.manual_seed(seed)
    return EagleHead(DrafterConfig.for_base(model.args)).bind(model).eval().requires_grad_(False)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", [[5], [3, 9, 4, 7, 2, 8, 11]])
def test_greedy_chain_equals_target(k, prompt):
    target = lean_from_hf(tiny_hf_llama(seed=3, vocab=128, init_std=0.2))
    ref = list(generate_tokens(target, prompt, 40))
    tl = ModelLevel(target, "target")
    chain = Chain([tl, EagleLevel(make_head(target), tl)], k=k)
    out, stats = chain.generate(prompt, 40)
    assert out == ref
    assert stats.levels[1]["forwards"] > 0


def test_head_drafts_that_stop_when_unsure_stay_exact():
    """draft_confidence ends a head's draft after a token it was unsure of (EAGLE-2's idea, on the head's raw
    logits when greedy): the output is still the target's, and drafts do end before k."""
    target = lean_from_hf(tiny_hf_llama(seed=3, vocab=128, init_std=0.2))
    prompt = [3, 9, 4, 7, 2, 8, 11]
    ref = list(generate_tokens(target, prompt, 40))
    tl = ModelLevel(target, "target")
    head = EagleLevel(make_head(target), tl)
    out, stats = Chain([tl, head], k=6, draft_confidence=0.3).generate(prompt, 40)
    assert out == ref
    assert any(0 < d < 6 for d in stats.links[0].drafted[:-1])
    g = torch.Generator().manual_seed(0)
    toks, q = head.propose(prompt, 6, SamplingConfig(temperature=1.0), g, frozenset(), min_confidence=0.99)
    assert len(toks) == 1 and head.confidence(0, toks[0], q[0], SamplingConfig(temperature=1.0)) < 0.99


def test_greedy_three_level_chain_head_on_middle():
    hf = tiny_hf_llama(seed=3, vocab=128, init_std=0.2)
    target, mid = lean_from_hf(hf), lean_from_hf(perturbed_copy(hf, 0.3))
    ref = list(generate_tokens(target, [3, 4, 5], 40))
    ml = ModelLevel(mid, "mid")
    chain = Chain([ModelLevel(target, "target"), ml, EagleLevel(make_head(mid), ml)], k=3, thresholds=[3])
    out, _ = chain.generate([3, 4, 5], 40)
    assert out == ref


def check_sampled_chain(head_for, seed: int, device: str = "cpu", **model_kw) -> None:
    """target + EagleLevel(head_for(target)) samples match the target's distribution (chi-square);
    the target (KW, updated by model_kw) and its head on `device` (the exact distributions are computed
    on the CPU)."""
    hf = tiny_hf_llama(seed=10, **{**KW, **model_kw})
    target = lean_from_hf(hf).to(device)
    sampling = SamplingConfig(temperature=1.0)
    p1, joint = exact_joint(hf, sampling)
    tl = ModelLevel(target, "target")
    chain = Chain([tl, EagleLevel(head_for(target).to(device), tl)], k=3)
    first, seqs = chain_sample_counts(chain, PROMPT, sampling, seed, N, V)
    assert chi_square_pvalue(first, p1) > P_MIN
    assert chi_square_pvalue(seqs, joint) > P_MIN


def test_sampled_chain_matches_target_distribution(device):
    check_sampled_chain(make_head, 1234, device)
