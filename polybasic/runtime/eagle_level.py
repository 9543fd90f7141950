"""EagleLevel: a chain's bottom level that drafts with an EAGLE head on its base level's features.

Head row p reads (x_{p+1}, f_p) (an eagle3 head: the base layers it fuses at p, or for a drafted
row its own output at p-1, as vLLM's eagle3 drafter feeds it). The exact features f_p come from the
base level's last score() forward (`base.hidden`, `base.hidden_start`), collected into a per-position store. Positions the base
has not computed (tokens the levels above added, e.g. a correction from the target) fall back to
the head's own prediction of that feature, as EAGLE does for the tokens it drafts. Before any base
forward (the first round of a generation) the level asks the base to score the prompt: that is the
prefill the base would do anyway, and its cache keeps it.

The head's KV cache is kept in sync like ModelLevel's: each cached row is keyed by (token, exact
feature?) and the longest shared prefix of keys is reused. Proposals come with the full-vocabulary
distributions they were sampled from, so the chain's verification stays exact.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor

from polybasic.config import SamplingConfig
from polybasic.models.eagle_head import EagleHead
from polybasic.runtime.chainspec import check_tree_width
from polybasic.runtime.levels import Level, ModelLevel, common_prefix
from polybasic.runtime.sampling import argmax, probs_from_logits, sample


class EagleLevel(Level):
    def __init__(self, head: EagleHead, base_level: ModelLevel, name: str = "eagle", tree_width: int = 1) -> None:
        """tree_width: draft token trees of this many candidates per depth (Level.propose_tree); 1: paths."""
        super().__init__()
        self.tree_width = check_tree_width(tree_width)
        if head.base is None:
            head.bind(base_level.model)
        self.head, self.base, self.name = head.eval(), base_level, name
        self.vocab_size = base_level.vocab_size
        self.tokenizer = base_level.tokenizer
        self.max_seq_len = base_level.max_seq_len

    def start(self, max_len: int) -> None:
        super().start(max_len)
        self.head.bind(self.base.model)  # the base returns the layers this head reads (another head may share it)
        self.head.setup_caches(max_len + 1)
        h, e = self.head, self.head.cfg.dim
        wide = e * (1 + len(self.head.cfg.feature_layers))  # the base's features: its other layers, then f_p
        self.feats = torch.zeros(max_len + 1, wide, dtype=h.dtype, device=h.device)  # [S, (n+1) E] exact
        self.ftoks: list[int] = []  # tokens whose positions have exact rows in self.feats
        self.hout = torch.zeros(max_len + 1, e, dtype=h.dtype, device=h.device)  # [S, E] head outputs per row
        self.keys: list[tuple[int, bool]] = []  # rows in the head's KV cache: (x_{p+1}, exact feature)
        self.seen_forward = -1

    def _absorb(self) -> None:
        """Copy the base's newest features into the store (rows hidden_start.. for base.cached)."""
        b = self.base
        if b.hidden is None or b.counters.forwards == self.seen_forward:
            return
        self.seen_forward = b.counters.forwards
        s, m = b.hidden_start, b.hidden.shape[0]
        keep = min(common_prefix(self.ftoks, b.cached), s)
        if keep < s:  # a gap of unknown features: keep only what is still valid
            self.ftoks = self.ftoks[:keep]
            return
        self.feats[s:s + m] = b.hidden.to(self.feats.dtype)
        self.ftoks = list(b.cached[:s + m])

    @torch.inference_mode()
    def _feed(self, toks: list[int], feats: Tensor, start: int) -> Tensor:
        """Run head rows start..start+len-1; returns their outputs [len, E] (also kept in hout)."""
        x = torch.tensor([toks], dtype=torch.long, device=feats.device)  # [1, M]
        out = self.head(x, feats[None], start)[0]  # [M, E]
        self.hout[start:start + len(toks)] = out
        self.counters.forwards += 1
        self.counters.tokens_fed += len(toks)
        return out

    @torch.inference_mode()
    def draft(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None,
              eos: frozenset[int], min_confidence: float = 0.0) -> tuple[list[int], Tensor, Tensor]:
        self._absorb()
        if not common_prefix(self.ftoks, context):  # no features yet: the base prefills the prompt
            self.base.cached = []  # recompute from position 0 (its cache may hold the prompt already)
            self.base.score(context, [], sampling)
            self._absorb()
        t0 = time.perf_counter()
        n = len(context)
        n_exact = common_prefix(self.ftoks, context)  # features of positions < n_exact are exact
        # rows 0..n-2 consume the context; row n-2's output predicts x_n (the first draft token)
        want = [(context[p + 1], p < n_exact) for p in range(n - 1)]
        r = max(0, min(common_prefix(self.keys, want), n - 2))
        self.keys = self.keys[:r]
        if n > 1:
            hi = max(r, min(n_exact, n - 1))  # rows r..hi-1 have exact features: one forward
            if hi > r:
                self._feed(context[r + 1:hi + 1], self.feats[r:hi], r)
            for p in range(hi, n - 1):  # rows past the base's features: the head's own predictions
                self._feed([context[p + 1]], self.hout[p - 1:p], p)
            self.keys = want
            probs = self._probs(self.hout[n - 2], sampling)  # [V]
        else:  # one-token context: no head row yet; the base's own distribution from f_0
            probs = self._probs(self.feats[0], sampling, self.head.base_logits)
        tokens: list[int] = []
        rows: list[Tensor] = []
        raw: list[Tensor] = []  # the head's logits of each draft token [V'] (Level.propose_tree ranks by them)
        for i in range(k):
            tok = int(argmax(probs)) if sampling.greedy else int(sample(probs, generator))
            tokens.append(tok)
            rows.append(probs)
            raw.append(self.logits[0])
            if tok in eos or i == k - 1 or self.unsure(0, tok, probs, sampling, min_confidence):
                break
            p = n - 1 + i  # the row reading the token just drafted
            exact = p < n_exact
            f = self.feats[p:p + 1] if exact else self.hout[p - 1:p]  # [1, E]
            out = self._feed([tok], f, p)[0]  # [E]
            self.keys.append((tok, exact))
            probs = self._probs(out, sampling)
        self.counters.time_s += time.perf_counter() - t0
        return tokens, torch.stack(rows), torch.stack(raw)

    def _probs(self, hidden: Tensor, sampling: SamplingConfig, head=None) -> Tensor:
        """Head features [E] -> the full-vocabulary distribution [V] a draft token is sampled from (through
        `head`, default the head's LM head); its raw logits are kept for confidence()."""
        self.logits = (head or self.head.logits)(hidden)[None]  # [1, V'] (the head's draft vocabulary; confidence)
        return self.head.to_full(probs_from_logits(self.logits[0], sampling))

    @property
    def columns(self) -> Tensor | None:  # the head's draft vocabulary (Level.columns)
        return self.head.d2t
