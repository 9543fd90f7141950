"""Tiny random-init models built from a config (no download)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from polybasic.models import build_model, hf_to_lean_state_dict
from polybasic.models.families import args_from_hf_config


def tiny_llama_config(vocab: int = 128, hidden: int = 64, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, tie: bool = True, max_pos: int = 256,
                      init_std: float = 0.02) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 32,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=tie,
                       bos_token_id=0, eos_token_id=1, pad_token_id=1,
                       initializer_range=init_std)


def tiny_hf_llama(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**kw)).eval()


def tiny_hf_qwen2(seed: int = 0, **kw) -> Qwen2ForCausalLM:
    """A tiny Qwen2 shaped like tiny_hf_llama's (same keywords), rope theta 1e6, and random q/k/v
    biases (transformers initialises them to zero, which would hide a wrong bias mapping)."""
    cfg = Qwen2Config(**{**tiny_llama_config(**kw).to_dict(), "model_type": "qwen2",
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return hf


TINY_HF = {"llama": tiny_hf_llama, "qwen2": tiny_hf_qwen2}  # family -> builder (same keywords)


def tiny_hf(family: str = "llama", seed: int = 0, **kw):
    return TINY_HF[family](seed, **kw)


def lean_from_hf(hf: LlamaForCausalLM, dtype=torch.float32):
    args = args_from_hf_config(hf.config)
    return build_model(args, hf_to_lean_state_dict(hf.state_dict(), args), dtype)


def perturbed_copy(hf, scale: float, seed: int = 1):
    """A copy of hf (any tiny family) with Gaussian noise (relative std `scale`) added to every weight."""
    g = torch.Generator().manual_seed(seed)
    copy = type(hf)(hf.config).eval()
    copy.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return copy


class ScriptedLM:
    """Stub with the lean decoder's interface whose logits come from a script of the context.

    script(context: list[int]) -> logits [V] for the next token. Keeps a token buffer indexed by
    position, so rollback (a call with a smaller `start`) behaves like a real KV cache.
    """

    def __init__(self, vocab: int, script, max_seq_len: int = 4096) -> None:
        from types import SimpleNamespace

        self.args = SimpleNamespace(vocab_size=vocab, max_seq_len=max_seq_len)
        self.script, self.device, self.buf, self.calls = script, torch.device("cpu"), [], 0

    def setup_caches(self, max_seq_len: int, batch: int = 1) -> None:
        self.buf = [0] * max_seq_len

    def __call__(self, tokens, start: int, last_only: bool = False, tail: int | None = None):
        self.calls += 1
        toks = tokens[0].tolist()
        self.buf[start:start + len(toks)] = toks
        rows = [torch.as_tensor(self.script(self.buf[:start + i + 1]), dtype=torch.float32)
                for i in range(len(toks))]
        logits = torch.stack(rows)[None]  # [1, M, V]
        tail = 1 if last_only else min(tail or len(toks), len(toks))
        return logits[:, -tail:], torch.zeros(1, len(toks), 4)  # as the lean decoder: the last `tail` rows


def one_hot_logits(vocab: int, token: int, peak: float = 20.0) -> torch.Tensor:
    out = torch.zeros(vocab)
    out[token] = peak
    return out


def word_tokenizer(vocab: int = 64):
    """A tiny word-level fast tokenizer with a chat template (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", "<user>", "<assistant>"] + [f"w{i}" for i in range(vocab - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}"
                          "{% endfor %}{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}")
    return fast


def tiny_hf_folder(path, vocab: int = 64, **kw):
    """Write a tiny random LlamaForCausalLM plus tokenizer as a Hugging Face folder."""
    hf = tiny_hf_llama(vocab=vocab, **kw)
    hf.save_pretrained(path)
    word_tokenizer(vocab).save_pretrained(path)
    return hf
