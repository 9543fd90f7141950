"""Greedy chain decoding equals greedy decoding of the target alone, token for token."""
import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.runtime.chain import Chain
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import TINY_HF, lean_from_hf, perturbed_copy, tiny_hf

# init_std 0.2 gives models with structure; perturbations chosen for partial acceptance
# (measured: close ~0.7, far ~0.25, small ~0 of drafted tokens accepted)
KW = dict(vocab=96, hidden=48, layers=2, heads=4, kv_heads=2, init_std=0.2)


@pytest.fixture(scope="module", params=list(TINY_HF))
def models(request, device):
    """Every level of one family (Llama, Qwen2 with q/k/v biases), on every device (conftest)."""
    hf = tiny_hf(request.param, seed=0, **KW)
    return {name: m.to(device) for name, m in {
        "target": lean_from_hf(hf),
        "close": lean_from_hf(perturbed_copy(hf, 0.02, seed=1)),
        "far": lean_from_hf(perturbed_copy(hf, 0.06, seed=2)),
        "small": lean_from_hf(tiny_hf(request.param, seed=3, **{**KW, "hidden": 32, "layers": 1})),
    }.items()}


CHAINS = {
    "n2-model": ["close"],
    "n2-ngram": ["ngram"],
    "n3-model-ngram": ["close", "ngram"],
    "n3-model-model": ["close", "small"],
    "n4-model-model-ngram": ["close", "far", "ngram"],
    "n4-model-model-model": ["close", "far", "small"],
}


def build(models, names, k, thresholds=None, adaptive_k=False, draft_confidence=0.0):
    levels = [ModelLevel(models["target"], "target")]
    levels += [NGramLevel(max_ngram=2) if n == "ngram" else ModelLevel(models[n], n) for n in names]
    return Chain(levels, k=k, thresholds=thresholds, eos={1}, adaptive_k=adaptive_k,
                 draft_confidence=draft_confidence)


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("k, adaptive", [(1, False), (4, False), (6, True)])
def test_greedy_identity(models, chain, k, adaptive):
    g = torch.Generator().manual_seed(hash(chain) % 1000 + k)
    for trial in range(3):
        prompt = torch.randint(2, 96, (12,), generator=g).tolist()
        prompt += prompt[:6]  # a repeat so the n-gram level finds matches
        ref = list(generate_tokens(models["target"], prompt, 48, eos={1}))
        c = build(models, CHAINS[chain], k, thresholds=[k + 2] * (len(CHAINS[chain]) - 1), adaptive_k=adaptive)
        out, stats = c.generate(prompt, 48)
        assert out == ref, f"{chain} trial {trial}"
        assert stats.new_tokens == len(ref)
        assert stats.target_forwards <= len(ref)


@pytest.mark.parametrize("chain", ["n2-model", "n3-model-ngram", "n4-model-model-model"])
def test_confidence_stop_keeps_greedy_identity_and_shortens_drafts(models, chain):
    """draft_confidence ends a bottom draft, and a middle level's hand-up, after a token the level was
    unsure of: the output stays the target's, and drafts really end before k / the threshold."""
    names, k, threshold = CHAINS[chain], 8, 10
    g = torch.Generator().manual_seed(7)
    short = 0
    for trial in range(3):
        prompt = torch.randint(2, 96, (12,), generator=g).tolist()
        ref = list(generate_tokens(models["target"], prompt, 48, eos={1}))
        c = build(models, names, k, thresholds=[threshold] * (len(names) - 1), draft_confidence=0.6)
        out, stats = c.generate(prompt, 48)
        assert out == ref, f"{chain} trial {trial}"
        bottom = stats.links[-1]
        short += sum(0 < d < k for d in bottom.drafted[:-1]) if names[-1] != "ngram" else 0
        short += sum(0 < d < threshold for d in stats.links[0].drafted[:-1]) if len(names) > 1 else 0
    assert short > 0  # the stop fired (without it every draft but the budget's last is k / >= threshold)


def test_a_level_runs_the_lm_head_on_the_rows_it_returns_only(models):
    """A prefill asks the model for its last row's logits alone (as vanilla's does), a catch-up over new
    context tokens for the draft's rows and one more; the distributions are the full forward's."""
    class Spy:
        def __init__(self, model):
            self.model, self.calls = model, []

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, tokens, start, **kw):
            self.calls.append((tokens.shape[1], start, kw))
            return self.model(tokens, start, **kw)

    spy = Spy(models["target"])
    lvl = ModelLevel(spy, "t")
    lvl.start(64)
    ctx = list(range(5, 25))
    p = lvl.score(ctx, [], SamplingConfig())
    assert spy.calls[-1] == (20, 0, {"tail": 1}) and p.shape[0] == 1 == lvl.logits.shape[0]
    full, _ = models["target"](torch.tensor([ctx], device=models["target"].device), 0)
    torch.testing.assert_close(lvl.logits[0], full[0, -1], rtol=1e-5, atol=1e-5)  # one GEMM row of 1 or 20
    p = lvl.score(ctx + [7, 8], [9, 10, 11], SamplingConfig())  # 2 new context tokens, 3 drafted
    assert spy.calls[-1] == (5, 20, {"tail": 4}) and p.shape[0] == 4 == lvl.logits.shape[0]


def test_levels_reused_across_generations_stay_exact(models):
    c = build(models, ["close", "ngram"], 3)
    for seed in range(3):
        prompt = torch.randint(2, 96, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = list(generate_tokens(models["target"], prompt, 30, eos={1}))
        assert c.generate(prompt, 30)[0] == ref


def test_stats_are_consistent(models):
    c = build(models, ["close", "small"], 4, thresholds=[5])
    prompt = list(range(5, 20))
    out, st = c.generate(prompt, 40)
    d = st.to_dict()
    assert d["new_tokens"] == len(out) and d["tau"] == pytest.approx(len(out) / st.target_forwards)
    top = d["links"][0]
    # every target verification yields accepted + 1 tokens, and they add up to the output
    assert top["verifications"] == st.target_forwards
    assert sum(k * v for k, v in top["histogram"].items()) == len(out)
    assert [lv["name"] for lv in d["levels"]] == ["target", "close", "small"]
    assert all(lv["forwards"] > 0 and lv["time_s"] > 0 for lv in d["levels"])
    assert 0 < top["draft_acceptance_rate"] < 1  # the fixture really exercises partial acceptance


def test_copies_of_the_target_take_its_prompt_kv_instead_of_prefilling(models):
    """Levels with the target's cache layout (here perturbed copies) copy the target's K/V of the
    prompt: they never feed a position of the prompt themselves, the target commits the first token
    from its prefill, the output still equals vanilla's, and share_prompt_kv=False restores their
    prefill. A level of another shape ("small") prefills as before."""

    class Spy:  # the model, recording the start position of every forward
        def __init__(self, model):
            self.model, self.starts = model, []

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, tokens, start, **kw):
            self.starts.append(start)
            return self.model(tokens, start, **kw)

    prompt = list(range(5, 45))  # 40 tokens
    ref = list(generate_tokens(models["target"], prompt, 24, eos={1}))
    for share in (True, False):
        close, small = Spy(models["close"]), Spy(models["small"])
        levels = [ModelLevel(models["target"], "target"), ModelLevel(close, "close"), ModelLevel(small, "small")]
        out, stats = Chain(levels, k=3, eos={1}, share_prompt_kv=share).generate(prompt, 24)
        assert out == ref
        assert (min(close.starts) >= len(prompt)) == share
        assert min(small.starts) == 0
        assert sum(stats.links[0].accepted) + len(stats.links[0].accepted) == len(out)  # every token counted
    # the copy's cache holds exactly the target's prompt K/V after the adoption
    t, c = ModelLevel(models["target"], "target"), ModelLevel(models["close"], "close")
    for lvl in (t, c):
        lvl.start(64)
    t.score(prompt, [], SamplingConfig())
    assert c.adopt_prefix(t, len(prompt)) and c.cached == prompt
    for a, b in zip(models["close"].layers, models["target"].layers):
        assert torch.equal(a.attention.kv_cache.k[:, :, :40], b.attention.kv_cache.k[:, :, :40])
        assert torch.equal(a.attention.kv_cache.v[:, :, :40], b.attention.kv_cache.v[:, :, :40])
    assert not ModelLevel(models["small"], "small").adopt_prefix(t, len(prompt))  # other shapes: refused
