"""The CPU peer in the bench: llama.cpp on the target's own GGUF (optional extra [peers]); skipped with
a clear message where llama-cpp-python is missing, run side by side with our vanilla where it is."""
import importlib.util

import pytest

from polybasic.bench.methods import parse_methods


def test_peers_are_skipped_with_the_install_line_when_missing(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert parse_methods("pld,llamacpp,llamacpp-pld") == ["vanilla", "pld"]
    err = capsys.readouterr().err
    for name in ("llamacpp", "llamacpp-pld"):
        assert f"[methods: {name} skipped: llama.cpp's Python binding is not installed: pip install " \
               "'polybasic[peers]'" in err
    # the build that runs on Intel Xeons with AMX, where a native one segfaults in llama_decode
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON ' \
           '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install "llama-cpp-python>=0.3"' in err


@pytest.mark.model
def test_llamacpp_decodes_the_targets_own_gguf_beside_vanilla():
    pytest.importorskip("llama_cpp", reason="the optional extra [peers] (llama-cpp-python) is not installed")
    from polybasic.bench.methods import BenchContext, make_runner
    from polybasic.models import load_model
    from polybasic.runtime.text import encode_prompt, eos_ids

    lm = load_model("smollm2-135m")
    prompts = [encode_prompt(lm.tokenizer, p) for p in ("Name three rivers in Europe.", "What is 7 times 8?",
                                                          "Write a haiku about the sea.")]
    long = encode_prompt(lm.tokenizer, "Summarize: " + "the river runs to the sea and back " * 80)
    assert len(long) > 512  # longer than llama.cpp's batch: prefilled in two batches
    ctx = BenchContext(lm.model, lm.tokenizer, eos_ids(lm.tokenizer), 16, gguf=lm.gguf_file,
                       prompt_tokens=(len(long),))
    ours, peer, pld = (make_runner(m, ctx) for m in ("vanilla", "llamacpp", "llamacpp-pld"))
    same_start = 0
    for ids in prompts:
        a, b, c = ours(ids, 0), peer(ids, 0), pld(ids, 0)
        assert 0 < len(b.tokens) <= 16 and b.wall_s > 0 and len(c.tokens) > 0
        # the same prefill: the same first token (later ones may differ: llama.cpp's batched verification
        # does not round as its one-token step does, so its prompt lookup drifts from its own greedy output)
        assert b.tokens[0] == c.tokens[0]
        same_start += a.tokens[:2] == b.tokens[:2]
    # other kernels (llama.cpp quantizes activations for its Q4_1 dot products): the same start on most prompts
    assert same_start >= 2
    assert len(peer(long, 0).tokens) > 0 and len(pld(long, 0).tokens) > 0
