"""Scripted-logits stub models: never / always / partial acceptance, EOS, budgets, thresholds, bad input."""
import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError
from polybasic.runtime.chain import Chain
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import ScriptedLM, one_hot_logits

V, EOS = 16, 1


def counting(offset_fn):
    """Script: next token = last + offset_fn(position) (mod V)."""
    return lambda ctx: one_hot_logits(V, (ctx[-1] + offset_fn(len(ctx))) % V)


def target_model():
    return ScriptedLM(V, counting(lambda pos: 1))


def level(model, name):
    return ModelLevel(model, name)


def run(chain_models, prompt, max_new, k=4, thresholds=None, eos=frozenset({EOS})):
    levels = [level(m, f"l{i}") if not isinstance(m, NGramLevel) else m for i, m in enumerate(chain_models)]
    chain = Chain(levels, k=k, thresholds=thresholds, eos=eos)
    return chain.generate(prompt, max_new)


def reference(prompt, max_new, eos=frozenset({EOS})):
    return list(generate_tokens(target_model(), prompt, max_new, eos=eos))


def test_always_accept():
    out, st = run([target_model(), target_model()], [2], 10, k=4, eos=frozenset())
    assert out == reference([2], 10, eos=frozenset())
    link = st.to_dict()["links"][0]
    assert link["draft_acceptance_rate"] == 1.0
    assert link["histogram"] == {5: 2}  # two rounds of 4 accepted + bonus


def test_never_accept():
    out, st = run([target_model(), ScriptedLM(V, counting(lambda pos: 2))], [2], 10, eos=frozenset())
    assert out == reference([2], 10, eos=frozenset())
    assert st.tau == 1.0 and st.to_dict()["links"][0]["draft_acceptance_rate"] == 0.0


def test_partial_accept():
    drafter = ScriptedLM(V, counting(lambda pos: 1 if pos % 3 else 3))  # wrong every third position
    out, st = run([target_model(), drafter], [2], 30, eos=frozenset())
    assert out == reference([2], 30, eos=frozenset())
    rate = st.to_dict()["links"][0]["draft_acceptance_rate"]
    assert 0 < rate < 1 and 1 < st.tau < 5


def test_eos_inside_a_draft_stops_generation():
    prompt = [10]  # target counts 11..15, 0, then 1 = EOS
    out, st = run([target_model(), target_model()], prompt, 40, k=5)
    assert out == reference(prompt, 40) == [11, 12, 13, 14, 15, 0, 1]
    assert st.stop_reason == "eos"


def test_drafter_eos_rejected_by_target():
    drafter = ScriptedLM(V, lambda ctx: one_hot_logits(V, EOS))  # always proposes EOS
    out, _ = run([target_model(), drafter], [3], 6)
    assert out == reference([3], 6) == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("max_new", [1, 2, 7, 11])
def test_max_new_tokens_reached_mid_chunk(max_new):
    mid = ScriptedLM(V, counting(lambda pos: 1 if pos % 4 else 2))
    out, st = run([target_model(), mid, target_model()], [2], max_new, k=5, thresholds=[4],
                  eos=frozenset())
    assert out == reference([2], max_new, eos=frozenset())
    assert len(out) == max_new and st.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("threshold", [1, 1000])
def test_thresholds_one_and_larger_than_any_chunk(threshold):
    mid = ScriptedLM(V, counting(lambda pos: 1 if pos % 5 else 2))
    out, st = run([target_model(), mid, NGramLevel()], [2, 3, 4, 2, 3], 25, k=3,
                  thresholds=[threshold], eos=frozenset())
    assert out == reference([2, 3, 4, 2, 3], 25, eos=frozenset())
    drafted = st.links[0].drafted  # chunk sizes the middle level handed up
    if threshold == 1000:  # every chunk fills the remaining budget, less the target's own token
        assert drafted[0] == 24
        assert all(d == 25 - done - 1 for d, done in zip(drafted, _cumulative(st.links[0])))
    else:  # one round of the middle level per chunk: at most k drafts + 1
        assert max(drafted) <= 4 and len(drafted) > 25 / 4


def _cumulative(link):
    done, out = 0, []
    for a in link.accepted:
        out.append(done)
        done += a + 1
    return out


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_bad_chains_are_refused_when_built():
    t = level(target_model(), "t")
    with pytest.raises(ConfigError, match="at least 2 levels"):
        Chain([])
    with pytest.raises(ConfigError, match="at least 2 levels"):
        Chain([t])
    with pytest.raises(ConfigError, match="^k: must be"):
        Chain([t, NGramLevel()], k=0)
    with pytest.raises(ConfigError, match=r"thresholds\[0\]: must be"):
        Chain([t, level(target_model(), "m"), NGramLevel()], thresholds=[0])
    with pytest.raises(ConfigError, match="one value per middle level"):
        Chain([t, NGramLevel()], thresholds=[3])
    with pytest.raises(ConfigError, match="vocabulary size 32 differs"):
        Chain([t, level(ScriptedLM(32, lambda c: one_hot_logits(32, 0)), "other")])
    with pytest.raises(ConfigError, match="cannot verify"):
        Chain([t, NGramLevel(), level(target_model(), "m")])
    a, b = level(target_model(), "a"), level(target_model(), "b")
    a.tokenizer, b.tokenizer = FakeTokenizer({"x": 0}), FakeTokenizer({"y": 0})
    with pytest.raises(ConfigError, match="tokenizer differs"):
        Chain([a, b])
    with pytest.raises(ConfigError, match="max_ngram"):
        NGramLevel(max_ngram=1, min_ngram=2)
    for bad in (1.0, -0.1, "0.5"):
        with pytest.raises(ConfigError, match=r"^draft_confidence: must be in \[0, 1\)"):
            Chain([t, NGramLevel()], draft_confidence=bad)


def test_a_chain_whose_levels_share_one_tokenizer_never_reads_its_vocabulary():
    """Reading a 150k-token vocabulary costs ~80 ms, and a Chain is built per request: levels that hold the target's
    own tokenizer object need no comparison; equal tokenizers of other objects still pass, different ones fail."""
    calls = []

    class Counting(FakeTokenizer):
        def get_vocab(self):
            calls.append(self)
            return super().get_vocab()

    shared = Counting({"x": 0})
    a, b = level(target_model(), "a"), level(target_model(), "b")
    a.tokenizer = b.tokenizer = shared
    Chain([a, b, NGramLevel()])
    assert calls == []
    b.tokenizer = Counting({"x": 0})
    Chain([a, b])
    assert len(calls) == 2
    b.tokenizer = Counting({"y": 0})
    with pytest.raises(ConfigError, match="tokenizer differs"):
        Chain([a, b])


def test_level_confidence_is_the_drawn_tokens_probability():
    """Greedy: under softmax of the raw logits (the processed distribution is one-hot); sampled: under
    the distribution the token was drawn from. Levels without logits (n-gram) never count as unsure."""
    lvl = level(target_model(), "t")
    greedy, t2 = SamplingConfig(), SamplingConfig(temperature=2.0)
    p = lvl.score([2, 3], [4], greedy)  # [2, V]
    soft = torch.softmax(lvl.logits.float(), -1)  # [2, V]
    tok = int(p[1].argmax())
    assert lvl.confidence(1, tok, p[1], greedy) == pytest.approx(float(soft[1, tok]))
    q = lvl.score([2, 3], [4], t2)
    assert lvl.confidence(0, 5, q[0], t2) == pytest.approx(float(q[0, 5]))
    assert NGramLevel().confidence(0, 5, q[0], t2) == 1.0


def test_bad_requests():
    chain = Chain([level(target_model(), "t"), NGramLevel()])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        chain.generate([2], 0)
    with pytest.raises(ConfigError, match="prompt: .* context window"):
        Chain([ModelLevel(ScriptedLM(V, counting(lambda p: 1), max_seq_len=8), "t"), NGramLevel()]).generate(
            list(range(8)), 4)


def test_ngram_lookup_prefers_longest_latest_match():
    ng = NGramLevel(max_ngram=3, min_ngram=1)
    assert ng.lookup([5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7], 3) == [8, 1, 5]
    assert ng.lookup([1, 2, 3], 4) == []
    assert ng.lookup([4, 9, 4], 2) == [9, 4]


@pytest.mark.parametrize("k,thresholds", [(1, [4]), (3, [5, 4]), (2, [1, 7]), (4, [])])
def test_no_level_scores_more_rows_in_a_call_than_scored_rows_says(k, thresholds):
    """Chain.scored_rows (what compiled steps must cover, or a call runs padded to the prefill chunk) bounds every
    level's calls under partial acceptance, and is reached."""
    wrong_every = [None] + [3 + i for i in range(len(thresholds) + 1)]  # each drafter errs at its own positions
    models = [target_model()] + [ScriptedLM(V, counting(lambda pos, n=n: 2 if pos % n == 0 else 1))
                                 for n in wrong_every[1:]]
    levels = [level(m, f"l{i}") for i, m in enumerate(models)]
    seen = [0] * (len(levels) - 1)
    for i, lvl in enumerate(levels[:-1]):
        def recording(ctx, draft, sampling, i=i, score=lvl.score):
            seen[i] = max(seen[i], len(draft) + 1)
            return score(ctx, draft, sampling)
        lvl.score = recording
    chain = Chain(levels, k=k, thresholds=thresholds, eos=frozenset())
    out, _ = chain.generate([2], 80)
    assert out == reference([2], 80, eos=frozenset())
    assert all(s <= b for s, b in zip(seen, chain.scored_rows)), (seen, chain.scored_rows)
    assert seen[-1] == chain.scored_rows[-1] == k + 1  # the level above the bottom scores k drafts + 1
    if len(thresholds) == 1:  # a partial acceptance then a full round: the middle hands up t - 1 + k + 1
        assert seen == chain.scored_rows
