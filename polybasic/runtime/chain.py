"""Lossless N-level (polybasic) speculative decoding.

Levels are ordered target first. The bottom level proposes up to `k` tokens. Every level above it
runs verification rounds: it asks the level below for a chunk, scores the whole chunk in ONE
forward, keeps the accepted prefix plus the corrected or bonus token (speculative sampling), and
repeats until it holds at least its threshold of tokens that the level above has not seen; then it
hands them up with its own distributions at those positions. A token that survived speculative
sampling at level i is an exact sample of level i's distribution, so those distributions are the
proposal distributions the level above must verify against. The target's rounds are the output.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from polybasic.config import SamplingConfig, check_draft_confidence
from polybasic.errors import ConfigError, check
from polybasic.runtime.generate import check_request
from polybasic.runtime.levels import Level, ModelLevel, kv_compatible
from polybasic.runtime.sampling import argmax, check_generator, sample
from polybasic.runtime.stats import ChainStats, LinkStats
from polybasic.runtime.tree_verify import rank_trials, verify_tree
from polybasic.runtime.verify import speculative_verify


class Chain:
    def __init__(self, levels: Sequence[Level], k: int = 5, thresholds: Sequence[int] | None = None,
                 eos: set[int] | frozenset[int] = frozenset(), adaptive_k: bool = False,
                 share_prompt_kv: bool = True, draft_confidence: float = 0.0) -> None:
        """levels: target first, bottom proposer last. thresholds: one per middle level
        (levels[1:-1]); default k + 1 each. adaptive_k: the bottom level's draft length starts at
        k and moves between 1 and k with its acceptance (+2 after a fully accepted draft, -1 after
        a rejection); it depends only on past verifications, so decoding stays lossless.
        share_prompt_kv: levels whose caches match the target's (a quantized copy of it) take the
        target's K/V of the prompt instead of prefilling it (see _share_prompt).
        draft_confidence: a drafting level ends what it hands up early, after a token it gave a
        probability below this (Level.confidence; 0: the bottom always drafts k tokens and a middle level
        hands up once it holds its threshold), so that k and the thresholds can be long where drafts are
        sure and short where they are not. Lossless: it depends only on the drafting level's own outputs.
        It cuts a bottom tree's path alike (a model's or head's), whose siblings then go only where the path's token
        was below it (levels.path_with_siblings; prompt lookup's nodes stay).
        A bottom level with a tree_width > 1 drafts token trees (k deep; an n-gram level that many leaves, a model or
        EAGLE level that many candidates per depth), which the level above verifies in one forward
        (runtime.tree_verify)."""
        levels = list(levels)
        check(len(levels) >= 2, "levels", f"a chain needs at least 2 levels, got {len(levels)}",
              "pass [target, drafter, ...]")
        check_k(k)
        check_draft_confidence(draft_confidence)
        n_mid = len(levels) - 2
        thresholds = [k + 1] * n_mid if thresholds is None else list(thresholds)
        check(len(thresholds) == n_mid, "thresholds",
              f"needs one value per middle level ({n_mid}), got {len(thresholds)}", "fix the list")
        for i, t in enumerate(thresholds):
            check(isinstance(t, int) and t >= 1, f"thresholds[{i}]", f"must be an integer >= 1, got {t!r}",
                  "a middle level hands up at least one token")
        for lvl in levels[:-1]:
            check(lvl.can_score, f"level '{lvl.name}'", "cannot verify (it only proposes)",
                  "place it at the bottom of the chain")
            check(lvl.tree_width == 1, f"level '{lvl.name}'", f"drafts token trees ({lvl.tree_width} wide) but "
                  "is not the chain's bottom level; only the bottom level drafts trees", "give it width 1")
        vocab = levels[0].vocab_size
        device = getattr(getattr(levels[0], "model", None), "device", None)
        for lvl in levels[1:]:
            if lvl.vocab_size is None:
                lvl.vocab_size = vocab
            if getattr(lvl, "device", False) is None:  # a model-free level drafts where the target verifies
                lvl.device = device
            elif lvl.vocab_size != vocab:
                raise ConfigError(f"level '{lvl.name}': vocabulary size {lvl.vocab_size} differs from the "
                                  f"target's {vocab}; every level must share the target's tokenizer")
        _check_tokenizers(levels)
        self.levels, self.k, self.thresholds = levels, k, [None] + thresholds + [None]
        self.tree_width = levels[-1].tree_width
        self.scored_rows = scored_rows(k, thresholds, len(levels), self.tree_width)  # most rows a level scores a call
        self.eos = frozenset(eos)
        self.adaptive_k = adaptive_k
        self.draft_confidence = draft_confidence
        self.share_prompt_kv = share_prompt_kv
        self.stats = ChainStats()

    # -- public API -----------------------------------------------------------------------------
    def stream(self, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
               generator: torch.Generator | None = None) -> Iterator[int]:
        """Yield new tokens as the target commits them. `self.stats` describes the run."""
        target = self.levels[0]
        budget = check_request(prompt, max_new_tokens, getattr(target, "max_seq_len", 1 << 30))
        device = getattr(getattr(target, "model", None), "device", None)  # where the target's probabilities are
        if device is not None:
            check_generator(None if sampling.greedy else generator, device)
        t0 = time.perf_counter()
        self.sampling, self.generator = sampling, generator
        self._k = self.k  # current draft length of the bottom level
        for lvl in self.levels:
            lvl.start(len(prompt) + budget + 1)  # a tree's branches past that are cut (Level.room)
        self.stats = st = ChainStats(prompt_tokens=len(prompt))
        st.links = [LinkStats(a.name, b.name) for a, b in zip(self.levels, self.levels[1:])]
        st.stop_reason = "max_new_tokens" if budget == max_new_tokens else "context_window"
        try:
            context = list(prompt)
            first = self._share_prompt(context)
            if first is not None:
                st.links[0].record(0, 0)  # a target forward over an empty draft: one token
                st.prompt_shared = True
                context.append(first)
            rounds = self._rounds(0, context, budget - len(context) + len(prompt))
            for new in itertools.chain([[first]] if first is not None else [], (new for new, _ in rounds)):
                for tok in new:
                    st.new_tokens += 1
                    st.wall_s = time.perf_counter() - t0
                    yield tok
                    if tok in self.eos:
                        st.stop_reason = "eos"
                        return
        finally:
            st.wall_s = time.perf_counter() - t0
            st.levels = [{"name": lvl.name, **lvl.counters.__dict__} for lvl in self.levels]

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                 generator: torch.Generator | None = None) -> tuple[list[int], ChainStats]:
        tokens = list(self.stream(prompt, max_new_tokens, sampling, generator))
        return tokens, self.stats

    # -- the algorithm ----------------------------------------------------------------------------
    def _takers(self) -> list[ModelLevel]:
        """The levels that can take the target's K/V of the prompt: model levels whose caches match
        the target's, unless an EAGLE head drafts on their features (it needs their prompt rows)."""
        target = self.levels[0]
        if not (self.share_prompt_kv and isinstance(target, ModelLevel)):
            return []
        below = self.levels[2:] + [None]
        return [lvl for lvl, nxt in zip(self.levels[1:], below)
                if isinstance(lvl, ModelLevel) and kv_compatible(lvl.model, target.model)
                and getattr(nxt, "base", None) is not lvl]

    def _share_prompt(self, prompt: list[int]) -> int | None:
        """If some level can take the target's K/V of the prompt (_takers) or reads the target's features
        (an EAGLE head on the target: it needs the target's prefill anyway), the target prefills the
        prompt first, as vanilla decoding does, and commits the next token from that distribution
        itself (exactly vanilla's first step: greedy argmax or one sample); the takers copy the
        prompt's K/V instead of running their own prefill, a head reads the prefill's features.
        Returns that token, or None (no such level)."""
        takers = self._takers()
        readers = self.share_prompt_kv and any(getattr(lvl, "base", None) is self.levels[0] for lvl in self.levels[1:])
        if not takers and not readers:
            return None
        target = self.levels[0]
        p = target.score(prompt, [], self.sampling)[0]  # [V] the target's distribution after the prompt
        tok = int(argmax(p)) if self.sampling.greedy else int(sample(p, self.generator))
        for lvl in takers:
            lvl.adopt_prefix(target, len(prompt))
        return tok

    def _rounds(self, i: int, context: list[int], cap: int) -> Iterator[tuple[list[int], Tensor]]:
        """Verification rounds of level i (< n) after `context`, at most `cap` tokens in all.
        Yields (new tokens, level i's distributions at their positions [len, V])."""
        lvl, produced = self.levels[i], []
        while len(produced) < cap:
            ctx = context + produced
            if self.tree_width > 1 and i == len(self.levels) - 2:
                n_acc, nxt, draft, p, drafted, full = self._tree_round(lvl, ctx, cap - len(produced) - 1)
            else:
                draft, q = self._chunk(i + 1, ctx, cap - len(produced) - 1)
                p = lvl.score(ctx, draft, self.sampling)  # [len(draft)+1, V]
                n_acc, nxt = speculative_verify(torch.tensor(draft, dtype=torch.long, device=p.device),
                                                q.to(p.device), p, self.sampling.greedy, self.generator)
                drafted, full = len(draft), n_acc == len(draft)
            self.stats.links[i].record(n_acc, drafted)
            if self.adaptive_k and i == len(self.levels) - 2 and drafted:
                self._k = min(self.k, self._k + 2) if full else max(1, self._k - 1)
            new = draft[:n_acc] + [nxt]
            ends = next((j for j, t in enumerate(new) if t in self.eos), None)
            if ends is not None:  # nothing after an EOS is worth handing up
                new = new[:ends + 1]
            produced += new
            yield new, p[:len(new)]
            if ends is not None:
                return

    def _tree_round(self, lvl: Level, context: list[int], cap: int
                    ) -> tuple[int, int, list[int], Tensor, int, bool]:
        """One verification of a tree the bottom level drafts (at most `cap` deep) by the level above it, `lvl`:
        -> (nodes kept, next token, the kept path's tokens, lvl's distributions after the context and after each
        kept node [kept+1, V], nodes drafted, whether the path ended at a leaf)."""
        bottom = self.levels[-1]
        tokens, parents, q = bottom.propose_tree(context, min(self._k, cap), self.tree_width, self.eos, self.sampling,
                                                 self.generator, self.draft_confidence) if cap > 0 else ([], [], None)
        room = lvl.room(context)  # the tree's rows must fit one forward: drop the last nodes (leaves first)
        tokens, parents = tokens[:room], parents[:room]
        p = lvl.score(context, tokens, self.sampling, parents=parents)  # [N+1, V]
        path, nxt = verify_tree(tokens, parents, q, p, self.sampling.greedy, self.generator)
        lvl.keep_path(context, tokens, parents, path)
        self.stats.links[-1].record_ranks(rank_trials(parents, path))
        leaf = bool(path) and path[-1] not in parents
        return len(path), nxt, [tokens[j] for j in path], p[[0] + [1 + j for j in path]], len(tokens), leaf

    def _chunk(self, j: int, context: list[int], cap: int) -> tuple[list[int], Tensor]:
        """What level j hands up to level j-1: at most `cap` tokens after `context`, with the
        distributions they were sampled from [len, V]."""
        lvl = self.levels[j]
        if cap <= 0:
            return [], torch.empty(0, lvl.vocab_size)
        if j == len(self.levels) - 1:
            return lvl.propose(context, min(self._k, cap), self.sampling, self.generator, self.eos,
                               self.draft_confidence)
        tokens: list[int] = []
        rows: list[Tensor] = []
        for new, p in self._rounds(j, context, cap):
            tokens += new
            rows.append(p)
            if len(tokens) >= self.thresholds[j] or lvl.unsure(len(new) - 1, new[-1], p[-1], self.sampling,
                                                               self.draft_confidence):
                break
        return tokens, torch.cat(rows)


def scored_rows(k: int, thresholds: Sequence[int] | None, n_levels: int, tree_width: int = 1) -> list[int]:
    """The most token rows each level but the bottom scores in one call (target first): a level scores the
    draft the level below hands up, plus one. The bottom hands up at most k (a tree: k * tree_width nodes, of
    which a path of at most k is kept); a middle level with threshold t
    stops once it holds t tokens, after a round of at most (the hand-up below) + 1, so it hands up at most
    t + (the hand-up below). Compiled steps should cover these sizes, or such calls run padded to the prefill
    chunk (docs/history.md: a 1.5B target's 10-row verifications padded to 64 rows)."""
    ts = [k + 1] * (n_levels - 2) if thresholds is None else list(thresholds)
    up, rows = k, []
    for t in reversed(ts):  # middle levels, bottom-most first
        rows.append(up + 1)
        up += t
    rows = [up + 1, *reversed(rows)]
    rows[-1] = k * tree_width + 1  # the level above the bottom
    return rows


def check_k(k: int) -> None:
    check(isinstance(k, int) and k >= 1, "k", f"must be an integer >= 1, got {k!r}",
          "the bottom level proposes k tokens per round")


def _check_tokenizers(levels: Sequence[Level]) -> None:
    toks = [(lvl.name, lvl.tokenizer) for lvl in levels if lvl.tokenizer is not None]
    if len(toks) < 2:
        return
    ref_name, ref = toks[0]
    others = [(name, tok) for name, tok in toks[1:] if tok is not ref]  # the same object needs no check
    ref_vocab = ref.get_vocab() if others else None  # ~80 ms on a 150k vocabulary: not per Chain without cause
    for name, tok in others:
        if tok.get_vocab() != ref_vocab:
            raise ConfigError(f"level '{name}': its tokenizer differs from level '{ref_name}''s; every "
                              "level must use the target's tokenizer")
