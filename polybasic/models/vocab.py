"""Reduced draft vocabularies: a drafting level's LM head computes the logits of N frequent tokens only.

`frequent_tokens` picks the ids from text a drafter will meet (an EAGLE head's answers, a quantized copy's
calibration records); `widen` puts a reduced head's logits back on the full vocabulary, so every consumer
of a model's logits keeps the target's token ids. A draft outside the reduced vocabulary is impossible, a
draft inside is verified by the level above as any other: the chain's output distribution is unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from polybasic.errors import ConfigError


def frequent_tokens(token_lists: Iterable[Sequence[int]], n: int, vocab_size: int,
                    always: Iterable[int] = ()) -> Tensor:
    """The n most frequent token ids of token_lists, sorted [n]; the ids in `always` (e.g. EOS) first, ties
    and the remainder (tokens never seen) by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        counts += torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab_size)
    counts[torch.as_tensor(sorted(set(always)), dtype=torch.long)] = counts.sum() + 1
    order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size))  # by count desc, then id asc
    return order[:n].sort().values


def check_draft_ids(ids: Tensor, vocab_size: int) -> None:
    """A draft vocabulary is 1 to V distinct token ids in [0, V) [N]; otherwise a ConfigError (on the meta
    device, where a load builds a model before its weights, the shape only)."""
    shape_ok = ids.dim() == 1 and 0 < len(ids) <= vocab_size
    if not shape_ok or not ids.is_meta and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size
                                            or len(ids.unique()) != len(ids)):
        raise ConfigError(f"draft vocabulary: needs 1 to {vocab_size} distinct token ids in [0, {vocab_size}) [N], "
                          f"got shape {tuple(ids.shape)}; e.g. frequent_tokens(texts, n, vocab_size)")


def widen(logits: Tensor, ids: Tensor | None, vocab_size: int) -> Tensor:
    """Logits over the token ids `ids` [..., N] -> over the vocabulary [..., V], -inf elsewhere (ids None:
    logits as they are)."""
    if ids is None:
        return logits
    return logits.new_full((*logits.shape[:-1], vocab_size), float("-inf")).index_copy_(-1, ids, logits)
