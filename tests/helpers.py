"""Tiny random-init models built from a config (no download)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from polybasic.models import ModelArgs, build_model, hf_to_lean_state_dict


def tiny_llama_config(vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, tie: bool = True, max_pos: int = 256) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 32,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=tie,
                       bos_token_id=0, eos_token_id=1, pad_token_id=1)


def tiny_hf_llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**kw)).eval()


def lean_from_hf(hf: LlamaForCausalLM, dtype=torch.float32):
    args = ModelArgs.from_hf_config(hf.config)
    return build_model(args, hf_to_lean_state_dict(hf.state_dict(), args), dtype)


def perturbed_copy(hf: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A copy of hf with Gaussian noise (relative std `scale`) added to every weight."""
    g = torch.Generator().manual_seed(seed)
    copy = LlamaForCausalLM(hf.config).eval()
    copy.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return copy
