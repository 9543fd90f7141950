"""Real Qwen2.5-Coder models from their chunk wheels (marker `big`: deselected by default, never in CI).

Run with `make test-big` (installs the chunk wheels, then `pytest -m big`). Each test loads one model
at a time in fp32 (0.5B: ~2 GB, 1.5B: ~6 GB, plus the conversion's transient copy on first use).
"""
import gc

import pytest
import torch

from polybasic.models.registry import REGISTRY

pytestmark = pytest.mark.big

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def _installed(name: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(pkg) is not None for pkg, _ in REGISTRY[name].chunks)


@pytest.mark.parametrize("name, layers, hidden", [("qwen2.5-coder-0.5b", 24, 896),
                                                   ("qwen2.5-coder-1.5b", 28, 1536)])
def test_packaged_qwen_greedy_equals_transformers(name, layers, hidden):
    """Assembled with the sha256 check, converted, loaded in the lean decoder: its greedy 16 tokens
    on a chat prompt equal transformers' on the same fp32 weights, and every linear reads codes
    that expand to its weight bit for bit."""
    if not _installed(name):
        pytest.skip(f"{name} is not installed: {REGISTRY[name].install_command}")
    from polybasic.models.gguf_codes import attach_codes
    from polybasic.models.loader import load_hf_model, load_model
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.text import encode_prompt, eos_ids

    lm = load_model(name)
    assert (lm.args.family, lm.args.n_layers, lm.args.dim, lm.args.qkv_bias) == ("qwen2", layers, hidden, True)
    assert lm.args.rope_theta == 1e6 and lm.tokenizer.chat_template
    ids = encode_prompt(lm.tokenizer, PROMPT)
    ours = list(generate_tokens(lm.model, ids, 16, eos=eos_ids(lm.tokenizer)))
    linears = {id(m): m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)}
    assert attach_codes(lm.model, lm.gguf_file) == len(linears)
    tokenizer = lm.tokenizer
    del lm, linears  # one fp32 model in memory at a time
    gc.collect()
    hf = load_hf_model(name)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          eos_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert ours == ref, (tokenizer.decode(ours), tokenizer.decode(ref))

def test_sibling_tokenizers_are_equal():
    """The 0.5B can be a chain level under the 1.5B: same tokenizer."""
    names = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    if not all(_installed(n) for n in names):
        pytest.skip("needs both Qwen2.5-Coder models: make test-big")
    from polybasic.models.loader import load_tokenizer, resolve_hf_folder
    from polybasic.models.tokenizer_check import check_same_tokenizer

    target, sibling = (load_tokenizer(resolve_hf_folder(n)) for n in names)
    check_same_tokenizer(target, sibling, names[1])
