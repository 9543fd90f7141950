"""With sampling, chain output is distributed exactly as the target's processed distribution.

Method: a fixed prompt, N seeded chain generations of 3 tokens each; Pearson chi-square tests of
(a) the first token against the target's processed next-token distribution and (b) the 3-token
sequence against the exact joint distribution computed from the target (cells with expected count
< 5 pooled). Bound: the test fails when p < 1e-3. With the fixed seeds the outcome is
deterministic; a correct sampler fails a single such test with probability 1e-3. The same test
applied to a deliberately wrong rule (always accept the draft) must fail, and does.
"""
import functools
import itertools

import pytest
import torch

import polybasic.runtime.chain as chain_mod
from polybasic.config import SamplingConfig
from polybasic.runtime.chain import Chain
from polybasic.runtime.levels import ModelLevel, NGramLevel
from polybasic.runtime.sampling import probs_from_logits
from tests.helpers import lean_from_hf, perturbed_copy, tiny_hf
from tests.stat_utils import chain_sample_counts, chi_square_pvalue

V, N, P_MIN = 16, 2500, 1e-3
PROMPT = [3, 7, 2, 3, 7]
KW = dict(vocab=V, hidden=32, layers=1, heads=2, kv_heads=1, init_std=0.3)
SAMPLINGS = {"t1": SamplingConfig(temperature=1.0), "t0.7-p0.9": SamplingConfig(temperature=0.7, top_p=0.9)}


@functools.cache
def make_world(family: str, device: str = "cpu"):
    """The reference HF target (on the CPU, for the exact distributions) and lean levels on `device`."""
    hf = tiny_hf(family, seed=10, **KW)
    models = {
        "target": lean_from_hf(hf),
        "mid": lean_from_hf(perturbed_copy(hf, 0.3, seed=11)),
        "far": lean_from_hf(perturbed_copy(hf, 0.8, seed=12)),
        "small": lean_from_hf(tiny_hf(family, seed=13, **{**KW, "hidden": 16})),
    }
    return hf, {name: m.to(device) for name, m in models.items()}


@pytest.fixture
def world(device):
    return make_world("llama", device)


def exact_joint(hf, sampling: SamplingConfig, prompt=tuple(PROMPT)) -> tuple[torch.Tensor, torch.Tensor]:
    """First-token distribution [V] and 3-token joint distribution [V, V, V] of the target after `prompt`."""
    with torch.no_grad():
        base = torch.tensor([list(prompt)])
        p1 = probs_from_logits(hf(base).logits[0, -1], sampling).double()  # [V]
        pairs = torch.tensor(list(itertools.product(range(V), repeat=1)))  # [V, 1]
        ctx2 = torch.cat([base.expand(V, -1), pairs], 1)  # [V, P+1]
        p2 = probs_from_logits(hf(ctx2).logits[:, -1], sampling).double()  # [V, V]
        pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))  # [V*V, 2]
        ctx3 = torch.cat([base.expand(V * V, -1), pairs], 1)
        p3 = probs_from_logits(hf(ctx3).logits[:, -1], sampling).double().view(V, V, V)
    return p1, p1[:, None, None] * p2[:, :, None] * p3


CHAINS = {"n2": ["mid"], "n3": ["mid", "small"], "n4": ["mid", "far", "ngram"]}
# every chain and sampling on Llama levels; one cheap case on Qwen2 levels (q/k/v biases)
CASES = [("llama", c, s) for c in CHAINS for s in SAMPLINGS] + [("qwen2", "n2", "t1")]


def sample_chain(models, names, sampling, seed, n=N, adaptive_k=False, draft_confidence=0.0, k=3, threshold=2):
    levels = [ModelLevel(models["target"], "target")]
    levels += [NGramLevel(max_ngram=2) if x == "ngram" else ModelLevel(models[x], x) for x in names]
    chain = Chain(levels, k=k, thresholds=[threshold] * (len(names) - 1), adaptive_k=adaptive_k,
                  draft_confidence=draft_confidence)
    return chain_sample_counts(chain, PROMPT, sampling, seed, n, V)


@pytest.mark.parametrize("family, cname, sname", CASES, ids=["-".join(c) for c in CASES])
def test_chain_samples_match_target(family, cname, sname, device):
    hf, models = make_world(family, device)
    sampling = SAMPLINGS[sname]
    p1, joint = exact_joint(hf, sampling)
    first, seqs = sample_chain(models, CHAINS[cname], sampling, seed=1234)
    assert chi_square_pvalue(first, p1) > P_MIN
    assert chi_square_pvalue(seqs, joint) > P_MIN


def test_adaptive_draft_length_stays_lossless(world):
    hf, models = world
    sampling = SAMPLINGS["t1"]
    p1, joint = exact_joint(hf, sampling)
    first, seqs = sample_chain(models, CHAINS["n3"], sampling, seed=99, adaptive_k=True)
    assert chi_square_pvalue(first, p1) > P_MIN
    assert chi_square_pvalue(seqs, joint) > P_MIN


def test_confidence_stop_stays_lossless(world):
    """Drafts and hand-ups that end on the drafting level's own confidence (long k and threshold, so the
    stop decides most lengths) still sample the target's joint distribution."""
    hf, models = world
    sampling = SAMPLINGS["t1"]
    p1, joint = exact_joint(hf, sampling)
    first, seqs = sample_chain(models, CHAINS["n3"], sampling, seed=77, draft_confidence=0.5, k=6, threshold=6)
    assert chi_square_pvalue(first, p1) > P_MIN
    assert chi_square_pvalue(seqs, joint) > P_MIN


def always_accept(draft, q, p, greedy, generator=None):
    """A WRONG rule: accept every draft token, then sample a bonus from p."""
    k = draft.shape[0]
    return k, int(torch.multinomial(p[k], 1, generator=generator))


def test_wrong_rule_is_detected(world, monkeypatch):
    hf, models = world
    sampling = SAMPLINGS["t1"]
    p1, joint = exact_joint(hf, sampling)
    monkeypatch.setattr(chain_mod, "speculative_verify", always_accept)
    first, seqs = sample_chain(models, ["far"], sampling, seed=1234)
    assert chi_square_pvalue(seqs, joint) < P_MIN
