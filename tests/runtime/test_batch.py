"""Batched, left-padded generation equals one-prompt-at-a-time generation."""
import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.runtime.batch import generate_batch
from polybasic.runtime.generate import generate_tokens
from tests.helpers import lean_from_hf, tiny_hf_llama

PROMPTS = [[5, 9, 2], [7, 3, 3, 8, 11, 4, 6], [12], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def model():
    return lean_from_hf(tiny_hf_llama(seed=3, init_std=0.2))


def test_greedy_batch_equals_single(model):
    out = generate_batch(model, PROMPTS, 12, eos={1})
    for p, o in zip(PROMPTS, out):
        assert o.tokens[:len(p)] == p and o.n_prompt == len(p)
        assert o.tokens[len(p):] == list(generate_tokens(model, p, 12, eos={1}))


def test_eos_stops_a_row_only(model):
    first = generate_tokens(model, PROMPTS[1], 12)
    stop = next(first)  # make the first generated token of prompt 1 an EOS
    out = generate_batch(model, PROMPTS, 12, eos={stop})
    assert out[1].tokens[len(PROMPTS[1]):] == [stop]
    for p, o in zip(PROMPTS, out):
        assert o.tokens[len(p):] == list(generate_tokens(model, p, 12, eos={stop}))


def test_sampled_rows_are_reproducible(model):
    s = SamplingConfig(temperature=1.0)
    a = generate_batch(model, PROMPTS, 8, s, generator=torch.Generator().manual_seed(0))
    b = generate_batch(model, PROMPTS, 8, s, generator=torch.Generator().manual_seed(0))
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert all(0 <= t < model.args.vocab_size for o in a for t in o.tokens)


def test_rows_finishing_at_different_steps_leave_the_batch(model):
    alone = [list(generate_tokens(model, p, 12)) for p in PROMPTS]
    eos = {alone[0][2], alone[2][5]}  # rows stop at different steps (and wherever else these tokens come up)
    out = generate_batch(model, PROMPTS, 12, eos=eos)
    for p, o in zip(PROMPTS, out):
        assert o.tokens[len(p):] == list(generate_tokens(model, p, 12, eos=eos))
    assert model.layers[0].attention.kv_cache.k.shape[0] < len(PROMPTS)  # the finished rows were dropped
