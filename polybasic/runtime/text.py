"""Prompt encoding (chat template) and incremental detokenization for streaming."""
from __future__ import annotations

from collections.abc import Iterable, Iterator


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True,
                  add_generation_prompt: bool = True) -> list[int]:
    """Token ids for a user prompt (or a list of chat messages), with the chat template if any,
    ending in the assistant turn's header unless add_generation_prompt is off."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = prompt
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return list(ids)
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
    return tokenizer.encode(text)


def eos_ids(tokenizer) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def stream_text(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """Yield text deltas as tokens arrive; holds back incomplete UTF-8 sequences."""
    ids: list[int] = []
    emitted = ""
    for t in tokens:
        ids.append(t)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        if text.startswith(emitted):
            delta, emitted = text[len(emitted):], text
            if delta:
                yield delta
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text.startswith(emitted) and len(text) > len(emitted):
        yield text[len(emitted):]
