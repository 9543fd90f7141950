"""Vanilla generation: greedy vs transformers, sampling reproducibility, EOS, limits, lookahead, errors."""
import copy

import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError
from polybasic.runtime.generate import GenerationStats, generate_tokens
from polybasic.runtime.sampling import make_generator, probs_from_logits
from polybasic.runtime.text import encode_prompt, stream_text
from tests.helpers import lean_from_hf, tiny_hf_llama, word_tokenizer


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf_llama(init_std=0.2)
    return hf, lean_from_hf(hf)


def test_greedy_matches_transformers_generate(pair):
    hf, lean = pair
    prompt = [5, 9, 12, 40, 3]
    ours = list(generate_tokens(lean, prompt, 30))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref


def test_sampling_is_seeded(pair):
    _, lean = pair
    s = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)
    a = list(generate_tokens(lean, [4, 5, 6], 25, s, generator=make_generator(7, lean.device)))
    b = list(generate_tokens(lean, [4, 5, 6], 25, s, generator=make_generator(7, lean.device)))
    c = list(generate_tokens(lean, [4, 5, 6], 25, s, generator=make_generator(8, lean.device)))
    assert a == b and a != c


def test_eos_stops_and_limits(pair):
    _, lean = pair
    free = list(generate_tokens(lean, [4, 5, 6], 20))
    eos = free[7]
    st = GenerationStats()
    out = list(generate_tokens(lean, [4, 5, 6], 20, eos={eos}, stats=st))
    assert out == free[:free.index(eos) + 1] and st.stop_reason == "eos"
    st = GenerationStats()
    assert len(list(generate_tokens(lean, [4, 5, 6], 5, stats=st))) == 5 and st.stop_reason == "max_new_tokens"
    # the context window (256 positions) caps a long request instead of overflowing the cache
    st = GenerationStats()
    assert len(list(generate_tokens(lean, [i % 100 for i in range(250)], 100, stats=st))) == 6
    assert st.stop_reason == "context_window"


def test_lookahead_gives_the_same_tokens_and_stats(pair, device):
    """Queuing the next forward before the host reads a token (CUDA's default) changes no token, stop or
    count, greedy or sampled, on every device; at an EOS the queued forward is dropped."""
    lean = copy.deepcopy(pair[1]).to(device)
    prompt = [4, 5, 6]
    s = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)
    free = list(generate_tokens(lean, prompt, 20, lookahead=False))
    for kw in (dict(), dict(eos={free[7]}), dict(sampling=s)):
        runs = []
        for ahead in (False, True):
            st = GenerationStats()
            gen = make_generator(3, device) if "sampling" in kw else None
            out = list(generate_tokens(lean, prompt, 20, generator=gen, stats=st, lookahead=ahead, **kw))
            runs.append((out, st.new_tokens, st.stop_reason))
        assert runs[0] == runs[1], kw
    assert runs[0][0] != free  # the sampled run is not the greedy one
    assert list(generate_tokens(lean, prompt, 20, eos={free[7]}, lookahead=True)) == free[:free.index(free[7]) + 1]


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=0), "max_new_tokens: must be a positive integer"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(prompt=list(range(256))), "prompt: 256 tokens do not fit the model's context window of 256"),
    (dict(prompt=[]), "prompt: is empty"),
])
def test_bad_requests(pair, bad, match):
    _, lean = pair
    kw = dict(prompt=[1, 2], max_new_tokens=4) | bad
    with pytest.raises(ConfigError, match=match):
        list(generate_tokens(lean, kw["prompt"], kw["max_new_tokens"]))


@pytest.mark.parametrize("kw, match", [
    (dict(top_p=0.0), "top_p: must be in \\(0, 1\\]"), (dict(top_p=1.2), "top_p"),
    (dict(temperature=-1), "temperature: must be >= 0"), (dict(top_k=-1), "top_k")])
def test_bad_sampling(kw, match):
    with pytest.raises(ConfigError, match=match):
        SamplingConfig(**kw)


def test_processed_distribution():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert (p[3:] == 0).all() and torch.allclose(p[:3], torch.softmax(logits[:3], -1))
    full = torch.softmax(logits, -1)  # [0.636, 0.234, 0.086, ...]
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert (p[2:] == 0).all() and torch.allclose(p[:2], full[:2] / full[:2].sum())
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.5))
    assert p[0] == 1.0  # the top token always stays
    g = probs_from_logits(logits, SamplingConfig())
    assert g.tolist() == [1.0, 0, 0, 0, 0]


def test_chat_template_and_streaming():
    tok = word_tokenizer()
    ids = encode_prompt(tok, "w1 w2")
    assert tok.decode(ids) == "<user> w1 w2 <assistant>"
    assert encode_prompt(tok, "w1 w2", chat=False) == tok.encode("w1 w2")
    tokens = tok.encode("w3 w4 w5")
    assert "".join(stream_text(tok, tokens)) == tok.decode(tokens, skip_special_tokens=True)
