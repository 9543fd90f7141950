"""Chain levels must share the target's tokenizer: a sibling model (e.g. `qwen2.5-coder-0.5b`
under `qwen2.5-coder-1.5b`) drafts token ids that the target verifies as its own."""
from __future__ import annotations

from polybasic.errors import ConfigError

# text whose encoding differs when normalisers, pre-tokenisers or merges differ
PROBE = "def f(x):\n    return x ** 2  # Grüße, 数字 123\t</s><|im_end|>"


def check_same_tokenizer(target_tok, level_tok, level_name: str) -> None:
    """ConfigError naming the level and the first difference unless both tokenizers map the same
    strings to the same ids (vocabulary, special tokens, and the encoding of a probe text)."""
    def fail(what: str) -> None:
        raise ConfigError(f"chain level '{level_name}': its tokenizer differs from the target's ({what}); "
                          "every level must use the target's tokenizer: pick a model of the same family "
                          "and tokenizer, e.g. a smaller sibling of the target")

    tv, lv = target_tok.get_vocab(), level_tok.get_vocab()
    if tv != lv:
        diff = sorted(set(tv.items()) ^ set(lv.items()), key=lambda kv: kv[1])[:3]
        fail(f"vocabularies of {len(tv)} and {len(lv)} entries; first differing (token, id): {diff}")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(target_tok, attr, None) != getattr(level_tok, attr, None):
            fail(f"{attr} {getattr(target_tok, attr, None)} vs {getattr(level_tok, attr, None)}")
    a, b = (t.encode(PROBE, add_special_tokens=False) for t in (target_tok, level_tok))
    if a != b:
        fail(f"a probe text encodes to {a[:8]}... vs {b[:8]}...")
