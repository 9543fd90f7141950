"""Self-distillation data: Alpaca / ShareGPT / JSONL prompts, clear errors, base-model answers."""
import json

import pytest

from polybasic.drafters.data import DEFAULT_DATA, DistillDataset, collate, load_prompts, self_distill
from polybasic.errors import ConfigError, DataNotFoundError
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.text import encode_prompt
from tests.helpers import lean_from_hf, tiny_hf_llama, word_tokenizer

ALPACA = [{"instruction": "w1 w2", "input": "w3", "output": "x"}, {"instruction": "w4", "input": "", "output": "y"}]
SHAREGPT = [{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "w5 w6"},
                               {"from": "gpt", "value": "z"}]}]


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_formats(tmp_path):
    assert load_prompts(write(tmp_path, "a.json", ALPACA)) == ["w1 w2\n\nw3", "w4"]
    assert load_prompts(write(tmp_path, "s.json", SHAREGPT)) == ["w5 w6"]
    jl = write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in ALPACA + SHAREGPT) + "\n")
    assert load_prompts(jl, limit=2) == ["w1 w2\n\nw3", "w4"]
    assert len(load_prompts(jl)) == 3


def test_errors(tmp_path):
    with pytest.raises(DataNotFoundError, match=r"distill\.data: .*nope\.json does not exist"):
        load_prompts(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="record 1 of .*Alpaca .*instruction.*ShareGPT .*conversations"):
        load_prompts(write(tmp_path, "bad.json", [{"question": "q"}]))
    with pytest.raises(ConfigError, match="not a list"):
        load_prompts(write(tmp_path, "dict.json", {"instruction": "x"}))
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_prompts(write(tmp_path, "broken.json", "[{"))
    with pytest.raises(ConfigError, match="holds no records"):
        load_prompts(write(tmp_path, "empty.json", []))
    with pytest.raises(ConfigError, match="no usable prompts"):
        load_prompts(write(tmp_path, "blank.json", [{"instruction": " "}]))
    with pytest.raises(ConfigError, match="empty"):
        DistillDataset([], 64)


def test_default_alpaca_file():
    prompts = load_prompts(DEFAULT_DATA, limit=5)
    assert len(prompts) == 5 and all(prompts)


def test_self_distill_answers_are_the_base_models(tmp_path):
    tok = word_tokenizer(64)
    model = lean_from_hf(tiny_hf_llama(vocab=64, init_std=0.2))
    prompts = load_prompts(write(tmp_path, "a.json", ALPACA))
    samples = self_distill(model, tok, prompts, max_new_tokens=8, eos=set())
    ids = encode_prompt(tok, prompts[0])
    assert samples[0].n_prompt == len(ids) and samples[0].tokens[:len(ids)] == ids
    assert samples[0].tokens[len(ids):] == list(generate_tokens(model, ids, 8))
    batch = collate(samples)
    assert batch["tokens"].shape == batch["mask"].shape
    assert batch["mask"][0, :len(ids)].sum() == 0 and batch["mask"][0, len(ids):].sum() == 8


def test_features_batched_equal_single_and_shards_round_trip(tmp_path):
    """Right-padded batched prefills give each sequence's own hidden states (to bf16 rounding),
    and a shard stores tokens, prompt lengths and features exactly."""
    import torch

    from polybasic.drafters.data import Sample, compute_features, load_feature_shard, save_feature_shard
    from tests.drafters.train_smoke import tiny_base

    base = tiny_base()
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(2, 64, (n,), generator=g).tolist(), 2) for n in (5, 9, 3, 12, 7)]
    feats = compute_features(base, samples, batch_tokens=24)
    for s, f in zip(samples, feats):
        with torch.inference_mode():
            base.setup_caches(len(s.tokens), 1)
            ref = base(torch.tensor([s.tokens]), 0)[1][0]  # [T, E]
        # A batched prefill runs its GEMMs at another M than the single one. Some CPUs' fp32 kernels
        # then sum in another order (a few ulps), which the bf16 cast can turn into one bf16 step.
        # The contract is the fp32 features rounded once to bf16, so: within one bf16 ulp (2^-7).
        assert f.dtype == torch.bfloat16
        torch.testing.assert_close(f.float(), ref, rtol=2 ** -7, atol=1e-6)
    path = tmp_path / "shard.safetensors"
    save_feature_shard(path, [Sample(s.tokens, s.n_prompt, f) for s, f in zip(samples, feats)])
    back = load_feature_shard(path)
    assert [(b.tokens, b.n_prompt) for b in back] == [(s.tokens, s.n_prompt) for s in samples]
    assert all(torch.equal(b.feats, f) for b, f in zip(back, feats))


def test_pairs_carry_reference_answers(tmp_path):
    from polybasic.drafters.data import load_pairs, reference_samples

    assert load_pairs(write(tmp_path, "a.json", ALPACA)) == [("w1 w2\n\nw3", "x"), ("w4", "y")]
    assert load_pairs(write(tmp_path, "s.json", SHAREGPT)) == [("w5 w6", "z")]
    tok = word_tokenizer(64)
    refs = reference_samples(tok, [("w1 w2", "w7 w8"), ("w4", None)], max_len=64)
    assert len(refs) == 1  # no answer, no sample
    prompt = encode_prompt(tok, "w1 w2")
    assert refs[0].n_prompt == len(prompt) and refs[0].tokens[:len(prompt)] == prompt
    assert len(refs[0].tokens) > len(prompt)


def test_self_instruct_prompts_open_a_user_turn_and_are_distinct():
    import pytest

    from polybasic.drafters.data import self_instruct, user_turn_prefix
    from polybasic.errors import ConfigError

    tok = word_tokenizer(64)
    assert user_turn_prefix(tok) == tok.encode("<user> ", add_special_tokens=False)
    model = lean_from_hf(tiny_hf_llama(vocab=64, init_std=0.2))
    prompts = self_instruct(model, tok, 6, max_tokens=40, batch_size=8, seed=3)
    assert 0 < len(prompts) <= 6 and len(set(prompts)) == len(prompts)
    assert all(len(p) >= 8 and "<eos>" not in p for p in prompts)
    assert self_instruct(model, tok, 6, max_tokens=40, batch_size=8, seed=3) == prompts  # seeded
    seeded = self_instruct(model, tok, 12, max_tokens=40, batch_size=4, seed=3, openings=["w5 w6", "w7"])
    assert seeded and all(p.startswith(("w5 w6 ", "w7 ")) for p in seeded)  # the opening begins the prompt
    assert all(len(p.split()) > 2 for p in seeded)  # and the model wrote more than the opening
    tok.chat_template = None
    with pytest.raises(ConfigError, match="self_instruct"):
        user_turn_prefix(tok)
