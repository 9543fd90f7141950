"""WithLookup: a drafting level whose every draft is a token tree that also holds prompt lookup's continuation.

A model or EAGLE head drafts well where text is new; prompt lookup (NGramLevel) drafts long runs for free where the
output repeats the context (code edits, extraction, summaries). Neither wins everywhere, so this level drafts both
into one tree: the drafter's path (or its own tree, tree_width > 1), then the n-gram continuation merged into it,
sharing the nodes whose tokens agree. The level above scores the tree in one forward (T(M) grows slowly in M) and
keeps the longest verified path: each verification accepts at least what the better of the two would have alone.

Lossless (runtime.tree_verify): at a node, the drafter's children come first, each with the distribution it was
drawn from; the n-gram child (a token that none of them has) comes last, one-hot. The n-gram token depends on the
context only, never on the drafter's draws or the verifier's coins, so after the drafter's children are rejected
(r: the residual left), trying it accepts with probability r(x) and otherwise samples r with x removed,
renormalized: an exact sample of r. Greedy: the path that follows the verifier's argmax, as every tree.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from polybasic.config import SamplingConfig
from polybasic.runtime.levels import Level, NGramLevel, graft, one_hot

# The shortest match whose continuation a LEVEL|ngram[:N] tree takes. A one-token match is a weak guess that still
# costs verification rows: on held-out prompts (the last 12 of work-mix-48 and Alpaca records 980-999, the EAGLE
# head at k 3, Qwen2.5-Coder-1.5B @w4a8, 2026-11-28) the continuation after a 1-gram match won 0.08 accepted tokens
# a node, after a 2-gram 0.18, after a 3-gram 0.38 (experiments/lookup_gain.py; docs/results.md, token trees).
LOOKUP_MIN_NGRAM = 2


class WithLookup(Level):
    """`drafter`'s trees (its path where its tree_width is 1) with `lookup`'s best continuation merged in. It takes the
    drafter's name, tokenizer, vocabulary and counters (the n-gram lookups add their time to them); its tree_width is
    the drafter's plus one, for the rows the verifier's steps must hold (runtime.chain.scored_rows)."""

    def __init__(self, drafter: Level, lookup: NGramLevel, name: str | None = None) -> None:
        super().__init__()
        self.drafter, self.lookup = drafter, lookup
        self.name = name or f"{drafter.name}|{lookup.name}"
        self.tokenizer = drafter.tokenizer
        self.vocab_size = drafter.vocab_size

    @property
    def tree_width(self) -> int:  # the chain verifies this level's drafts as trees
        return self.drafter.tree_width + 1

    @property
    def base(self):
        """The level whose features the drafter reads (an EAGLE head's), for the chain's prefill sharing."""
        return getattr(self.drafter, "base", None)

    def start(self, max_len: int) -> None:
        self.drafter.start(max_len)
        self.counters = self.drafter.counters

    def propose_tree(self, context: list[int], k: int, width: int, eos: frozenset[int],
                     sampling: SamplingConfig = SamplingConfig(), generator: torch.Generator | None = None,
                     min_confidence: float = 0.0) -> tuple[list[int], list[int], Tensor]:
        """The drafter's tree (its own width: `width` less the lookup's one; its path cut by min_confidence), then the
        lookup's continuation of at most k tokens (cut after an EOS) merged in: shared starts once, new nodes
        one-hot, after the drafter's."""
        tokens, parents, q = self.drafter.propose_tree(context, k, self.drafter.tree_width, eos, sampling, generator,
                                                       min_confidence)
        t0 = time.perf_counter()
        tokens, parents = list(tokens), list(parents)
        added = graft(tokens, parents, self.lookup.lookup(context, k), eos)
        self.counters.time_s += time.perf_counter() - t0
        return tokens, parents, torch.cat((q, one_hot(added, q.shape[1], q.device).to(q)))  # [N, V]


def drafting(level: Level) -> Level:
    """The level that runs a model or head for `level`: its drafter for a WithLookup, else itself (what compiling and
    timing a level act on; the lookup costs a few microseconds)."""
    return level.drafter if isinstance(level, WithLookup) else level
