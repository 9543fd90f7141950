"""llama.cpp (llama-cpp-python, the optional extra [peers]) as a peer engine, loaded in the child process
of polybasic.bench.peer_worker (never in the bench's own process: a crash of the native library ends
the method, not the run).

settings (from polybasic.bench.methods): gguf, n_ctx, threads, gpu, max_new_tokens, eos, temperature,
top_k, top_p, and for llamacpp_pld draft_tokens.
"""
from __future__ import annotations

import atexit
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def _llama(settings: dict, **kw) -> llama_cpp.Llama:
    """llama.cpp on the target's GGUF, the parent's CPU threads, a context for the run's longest prompt."""
    llm = llama_cpp.Llama(model_path=settings["gguf"], n_ctx=settings["n_ctx"], n_batch=512,
                          n_threads=settings["threads"], n_threads_batch=settings["threads"],
                          n_gpu_layers=-1 if settings["gpu"] else 0, verbose=False, **kw)
    atexit.register(llm.close)  # freed before interpreter shutdown (its finalizer fails once modules are gone)
    return llm


def _decoder(settings: dict, llm: llama_cpp.Llama):
    """Our prompt ids (the same chat template) into llama.cpp, its own sampler set to ours (greedy at
    temperature 0; no min-p, repetition or other penalties), stopping at our EOS ids or the budget."""
    eos, budget = set(settings["eos"]), settings["max_new_tokens"]

    def decode(prompt_ids: list[int], seed: int) -> tuple[list[int], float]:
        llm.reset()
        llm.set_seed(seed)
        tokens = []
        t0 = time.perf_counter()
        for tok in llm.generate(prompt_ids, temp=settings["temperature"], top_k=settings["top_k"],
                                top_p=settings["top_p"], min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            if tok in eos or len(tokens) >= budget:
                break
        return tokens, time.perf_counter() - t0
    return decode


def llamacpp(settings: dict):
    """llama.cpp's own decoding of the GGUF."""
    return _decoder(settings, _llama(settings))


def llamacpp_pld(settings: dict):
    """llama.cpp with its prompt-lookup drafts (LlamaPromptLookupDecoding, k = draft_tokens, n-grams up to 3)."""
    # logits_all: its draft path reads every position's logits (without it a prompt longer than n_batch fails)
    return _decoder(settings, _llama(settings, logits_all=True, draft_model=LlamaPromptLookupDecoding(
        max_ngram_size=3, num_pred_tokens=settings["draft_tokens"])))
