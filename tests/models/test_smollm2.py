"""The real default target (SmolLM2-135M-Instruct from its PyPI GGUF): our decoder vs transformers."""
import json

import pytest
import torch

from polybasic.data.catalog import SPEC_BENCH, shipped_path
from polybasic.models import load_hf_model, load_model
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.text import encode_prompt, eos_ids

pytestmark = pytest.mark.model
QUESTIONS = shipped_path(SPEC_BENCH)


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    yield load_model("smollm2-135m"), load_hf_model("smollm2-135m")
    torch.set_num_threads(1)


def spec_bench_prompts(n: int) -> list[dict]:
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return rows[::len(rows) // n][:n]  # spread over the categories


def test_model_facts(smollm2):
    lm, _ = smollm2
    a = lm.args
    assert (a.n_layers, a.dim, a.vocab_size, a.n_heads, a.n_kv_heads) == (30, 576, 49152, 9, 3)
    assert lm.tokenizer.chat_template and lm.tokenizer.eos_token == "<|im_end|>"


def test_greedy_64_tokens_match_transformers_on_spec_bench(smollm2):
    lm, hf = smollm2
    results = []
    for q in spec_bench_prompts(10):
        ids = encode_prompt(lm.tokenizer, q["turns"][0])
        ours = list(generate_tokens(lm.model, ids, 64, eos=eos_ids(lm.tokenizer)))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        results.append((q["category"], ours == ref))
    matched = sum(ok for _, ok in results)
    assert matched >= 9, results  # fp32 sums in another order may flip one near-tie


def test_every_linear_reads_the_gguf_codes_exactly(smollm2):
    """The packaged GGUF (Q4_1 blocks, Q8_0 embedding) expands to our fp32 weights bit for bit, so
    compiled steps may read its codes for all 121 linears (4 fused per layer x 30 + the tied LM head)."""
    import copy

    from polybasic.models.gguf_codes import attach_codes

    lm, _ = smollm2
    assert lm.gguf_file is not None and lm.gguf_file.suffix == ".gguf"
    assert attach_codes(copy.deepcopy(lm.model), lm.gguf_file) == 4 * 30 + 1
