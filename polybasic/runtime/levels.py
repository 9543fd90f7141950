"""Chain levels behind one small interface.

A level sees the whole token context on every call and keeps its own cache in sync by itself: it
remembers which tokens its KV cache holds and reuses the longest prefix shared with the new context
(that is the rollback). Two operations:
- score(context, draft): ONE forward over the unseen context tokens plus the draft; returns the
  processed distributions at the len(draft) draft positions and one past them, [len(draft)+1, V].
- propose(context, k): k tokens drafted autoregressively, with the distributions they were
  sampled from, [k, V].
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from polybasic.config import SamplingConfig
from polybasic.errors import check
from polybasic.models.gguf_codes import ROW_INVARIANT_DTYPES
from polybasic.runtime.sampling import probs_from_logits, sample


@dataclass
class LevelCounters:
    forwards: int = 0
    time_s: float = 0.0
    tokens_fed: int = 0


class Level:
    """Base class: name, vocabulary size and per-generation counters."""

    name: str = "level"
    vocab_size: int | None = None
    can_score: bool = False
    tokenizer = None

    def __init__(self) -> None:
        self.counters = LevelCounters()

    def start(self, max_len: int) -> None:
        """Prepare for a new generation whose sequence never exceeds max_len tokens."""
        self.counters = LevelCounters()

    def score(self, context: list[int], draft: list[int], sampling: SamplingConfig) -> Tensor:
        raise NotImplementedError(f"level '{self.name}' cannot verify; put it at the bottom of the chain")

    logits: Tensor | None = None  # raw logits of the rows of its last score or draft step [R, V'] (None: none)

    def full(self, probs: Tensor) -> Tensor:
        """Probabilities over the level's own logits' vocabulary [..., V'] -> the target's [..., V]."""
        return probs

    def confidence(self, row: int, tok: int, probs: Tensor, sampling: SamplingConfig) -> float:
        """How sure the level was of `tok`, drawn from its distribution `probs` [V] at row `row` of its last
        score or draft step: probs[tok], or under softmax(raw logits) when greedy (whose probs are one-hot);
        1.0 for a level without logits (it cannot tell)."""
        if self.logits is None:
            return 1.0
        if not sampling.greedy:
            return float(probs[tok])
        return float(self.full(torch.softmax(self.logits[row].float(), -1))[tok])

    def unsure(self, row: int, tok: int, probs: Tensor, sampling: SamplingConfig, threshold: float) -> bool:
        """Whether `threshold` (a draft confidence, 0: off) ends a draft after `tok` (see confidence)."""
        return threshold > 0 and self.confidence(row, tok, probs, sampling) < threshold

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, eos: frozenset[int],
                min_confidence: float = 0.0) -> tuple[list[int], Tensor]:
        """Up to k tokens after context, with the distributions they were drawn from [len, V]. A level
        that can tell its confidence (ModelLevel, EagleLevel) stops after a token it gave less than min_confidence."""
        raise NotImplementedError


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class ModelLevel(Level):
    """Any causal LM with the lean decoder's interface: forward(tokens [1, M], start) -> (logits, hidden).

    After each forward, `hidden` [M, E] holds the last layer's features of the fed positions
    (`hidden_start` is the position of its first row): what an EAGLE drafter head reads.
    """

    can_score = True

    def __init__(self, model, name: str = "model", tokenizer=None) -> None:
        super().__init__()
        self.model, self.name, self.tokenizer = model, name, tokenizer
        self.vocab_size = model.args.vocab_size
        self.max_seq_len = model.args.max_seq_len
        self.cached: list[int] = []  # tokens whose K/V sit in the cache, positions 0..len-1
        self.hidden: Tensor | None = None
        self.hidden_start = 0

    def start(self, max_len: int) -> None:
        super().start(max_len)
        self.model.setup_caches(max_len)
        self.cached = []

    @torch.inference_mode()
    def adopt_prefix(self, source: "ModelLevel", n: int) -> bool:
        """Copy the K/V of positions 0..n-1 from `source`'s cache into this level's, instead of
        prefilling them itself; e.g. a quantized copy of the target takes the target's keys and values
        of the prompt (its prefill of a long prompt costs as much as the target's). Only this level's
        own distributions change, never what a chain commits: the level above verifies them. Returns
        False, doing nothing, when the two models' caches differ in shape or RoPE (kv_compatible)."""
        if len(source.cached) < n or not kv_compatible(self.model, source.model):
            return False
        for mine, theirs in zip(self.model.layers, source.model.layers):
            a, b = mine.attention.kv_cache, theirs.attention.kv_cache
            if a.k.shape[2] < n:
                return False
            a.k[:, :, :n].copy_(b.k[:, :, :n])  # [B, G, n, D]
            a.v[:, :, :n].copy_(b.v[:, :, :n])
        self.cached, self.hidden = list(source.cached[:n]), None
        return True

    @torch.inference_mode()
    def score(self, context: list[int], draft: list[int], sampling: SamplingConfig) -> Tensor:
        t0 = time.perf_counter()
        seq = context + draft
        # reuse the cached prefix shared with this context, but always feed >= 1 context token so
        # the logits at the last context position (predicting draft[0]) are produced
        start = min(common_prefix(self.cached, context), len(context) - 1)
        c = self.counters
        dev = self.model.device
        if start == 0 and draft and getattr(self.model, "dtype", None) in ROW_INVARIANT_DTYPES:
            # bf16/fp16: prefill the context alone, as vanilla decoding does, so its cached rows have
            # vanilla's exact bits (a prefill's rows change with its length in reduced precision)
            pre_logits, pre_hidden = self.model(torch.tensor([context], dtype=torch.long, device=dev), 0,
                                                last_only=True)  # [1, 1, V]
            logits, hidden = self.model(torch.tensor([draft], dtype=torch.long, device=dev), len(context))
            logits = torch.cat((pre_logits, logits), dim=1)  # [1, len(draft)+1, V]
            hidden = torch.cat((pre_hidden, hidden), dim=1)  # [1, len(seq), E]
            c.forwards += 1  # the extra forward is the prefill vanilla decoding runs too
        else:  # the LM head runs on the rows whose distributions are returned only (a prefill's last)
            logits, hidden = self.model(torch.tensor([seq[start:]], dtype=torch.long, device=dev), start,
                                        tail=len(draft) + 1)  # [1, len(draft)+1, V], [1, M, E]
        self.cached = seq
        self.hidden, self.hidden_start = hidden[0], start
        self.logits = logits[0, -(len(draft) + 1):]  # [len(draft)+1, V] (confidence)
        probs = probs_from_logits(self.logits, sampling)  # [len(draft)+1, V]
        c.forwards += 1
        c.tokens_fed += len(seq) - start
        c.time_s += time.perf_counter() - t0
        return probs

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, eos: frozenset[int],
                min_confidence: float = 0.0) -> tuple[list[int], Tensor]:
        tokens: list[int] = []
        rows: list[Tensor] = []
        for _ in range(k):
            probs = self.score(context + tokens, [], sampling)[0]  # [V]
            tok = int(probs.argmax()) if sampling.greedy else int(sample(probs, generator))
            tokens.append(tok)
            rows.append(probs)
            if tok in eos or self.unsure(0, tok, probs, sampling, min_confidence):
                break
        return tokens, torch.stack(rows) if rows else torch.empty(0, self.vocab_size)


def kv_compatible(a, b) -> bool:
    """Whether lean decoders a and b cache keys and values alike: the same layer count, KV heads, head
    size, RoPE, dtype and device (a quantized copy of a model and the model itself), and not one model.
    Decided from their configurations, before any cache is allocated."""
    if a is b or not (hasattr(a, "args") and hasattr(b, "args") and hasattr(a, "layers") and hasattr(b, "layers")):
        return False
    fields = ("n_layers", "n_kv_heads", "head_dim", "rope_theta", "max_seq_len")
    if any(getattr(a.args, f, None) != getattr(b.args, f, None) for f in fields):
        return False
    return a.dtype == b.dtype and a.device == b.device  # the caches' dtype (and the RoPE tables')


class NGramLevel(Level):
    """Model-free prompt-lookup proposer: continue the latest earlier occurrence of the context's
    last n-gram (n from max_ngram down to min_ngram). Its proposals are deterministic, so their
    distributions are one-hot and speculative sampling stays exact."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "ngram",
                 vocab_size: int | None = None) -> None:
        super().__init__()

        check(min_ngram >= 1, "min_ngram", f"must be >= 1, got {min_ngram}", "use 1 or more")
        check(max_ngram >= min_ngram, "max_ngram", f"must be >= min_ngram ({min_ngram}), got {max_ngram}",
              "raise max_ngram")
        self.max_ngram, self.min_ngram, self.name, self.vocab_size = max_ngram, min_ngram, name, vocab_size
        self.device: torch.device | None = None  # where its one-hot rows are made (a Chain sets the target's)

    def lookup(self, context: list[int], k: int) -> list[int]:
        ctx = np.asarray(context, dtype=np.int64)
        n_ctx = len(ctx)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ctx[n_ctx - n:]
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:n_ctx - 1], n)  # [n_ctx-n, n]
            hits = np.flatnonzero((windows == tail).all(axis=1))
            hits = hits[hits + n < n_ctx]  # must have a continuation
            if hits.size:
                s = int(hits[-1]) + n
                return ctx[s:s + k].tolist()
        return []

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, eos: frozenset[int],
                min_confidence: float = 0.0) -> tuple[list[int], Tensor]:
        t0 = time.perf_counter()
        tokens = self.lookup(context, k)
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[:i + 1]
                break
        q = torch.zeros(len(tokens), self.vocab_size, device=self.device)  # [len, V]
        if tokens:
            q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        self.counters.forwards += 1
        self.counters.time_s += time.perf_counter() - t0
        return tokens, q
