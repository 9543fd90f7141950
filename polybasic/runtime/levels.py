"""Chain levels behind one small interface.

A level sees the whole token context on every call and keeps its own cache in sync by itself: it
remembers which tokens its KV cache holds and reuses the longest prefix shared with the new context
(that is the rollback). Two operations:
- score(context, draft): ONE forward over the unseen context tokens plus the draft; returns the
  processed distributions at the len(draft) draft positions and one past them, [len(draft)+1, V].
- propose(context, k): k tokens drafted autoregressively, with the distributions they were
  sampled from, [k, V].
Token trees (runtime.tree_verify): a bottom level with a tree_width > 1 drafts a tree with propose_tree, and the
level above scores it in one forward (score with parents), then keeps the verified path's cache rows with keep_path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from polybasic.config import SamplingConfig
from polybasic.errors import check
from polybasic.models import tree as token_tree
from polybasic.models.gguf_codes import ROW_INVARIANT_DTYPES
from polybasic.runtime.chainspec import check_tree_width
from polybasic.runtime.sampling import argmax, probs_from_logits, sample


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
    tree_width: int = 1  # > 1: drafts token trees of up to this many leaves (propose_tree)
    tokenizer = None

    def __init__(self) -> None:
        self.counters = LevelCounters()

    def start(self, max_len: int) -> None:
        """Prepare for a new generation whose sequence never exceeds max_len tokens."""
        self.counters = LevelCounters()

    def score(self, context: list[int], draft: list[int], sampling: SamplingConfig) -> Tensor:
        raise NotImplementedError(f"level '{self.name}' cannot verify; put it at the bottom of the chain")

    logits: Tensor | None = None  # raw logits of the rows of its last score or draft step [R, V'] (None: none)
    columns: Tensor | None = None  # the target's token ids of its logits' columns [V'] (None: the target's own)

    def confidence(self, row: int, tok: int, probs: Tensor, sampling: SamplingConfig) -> float:
        """How sure the level was of `tok`, drawn from its distribution `probs` [V] at row `row` of its last
        score or draft step: probs[tok], or under softmax(raw logits) when greedy (whose probs are one-hot);
        1.0 for a level without logits (it cannot tell)."""
        if self.logits is None:
            return 1.0
        if not sampling.greedy:
            return float(probs[tok])
        col = column_of(tok, self.columns)
        return 0.0 if col is None else float(torch.softmax(self.logits[row].float(), -1)[col])

    def unsure(self, row: int, tok: int, probs: Tensor, sampling: SamplingConfig, threshold: float) -> bool:
        """Whether `threshold` (a draft confidence, 0: off) ends a draft after `tok` (see confidence)."""
        return threshold > 0 and self.confidence(row, tok, probs, sampling) < threshold

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, eos: frozenset[int],
                min_confidence: float = 0.0) -> tuple[list[int], Tensor]:
        """Up to k tokens after context, with the distributions they were drawn from [len, V]. A level
        that can tell its confidence (ModelLevel, EagleLevel) stops after a token it gave less than min_confidence.
        This base: draft's tokens and distributions."""
        return self.draft(context, k, sampling, generator, eos, min_confidence)[:2]

    def room(self, context: list[int]) -> int:
        """How many draft rows score(context, ...) can take in one forward (a tree's rows; unbounded: huge)."""
        return 1 << 30

    def propose_tree(self, context: list[int], k: int, width: int, eos: frozenset[int],
                     sampling: SamplingConfig = SamplingConfig(), generator: torch.Generator | None = None,
                     min_confidence: float = 0.0) -> tuple[list[int], list[int], Tensor]:
        """A token tree after context, at most k deep: (tokens [N], parents [N], -1 for the context's children; the
        distributions each node was drawn from [N, V]; see runtime.tree_verify). A drafting level's (this base):
        its path (propose, ended early after a token it gave less than min_confidence), and up to width-1 more
        candidates for a position as leaves (path_with_siblings): at each depth, or with a min_confidence only where
        the path's token had less (the depth where the path ends); nodes 0..len(path)-1 are the path, whose cache
        rows need no move when it is kept."""
        tokens, q, logits = self.draft(context, k, sampling, generator, eos, min_confidence)
        return path_with_siblings(tokens, q, logits, width, sampling.greedy, generator, self.columns,
                                  min_confidence)

    def draft(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None,
              eos: frozenset[int], min_confidence: float = 0.0) -> tuple[list[int], Tensor, Tensor]:
        """propose's tokens [n] and distributions [n, V], and the raw logits each was drawn from [n, V'] (a level
        that drafts from logits: ModelLevel, EagleLevel)."""
        raise NotImplementedError(f"level '{self.name}' cannot draft")


def column_of(tok: int, columns: Tensor | None) -> int | None:
    """The column of token `tok` in logits over `columns` [V'] (None: the target's vocabulary: tok itself);
    None where the columns do not hold it."""
    if columns is None:
        return tok
    hit = (columns == tok).nonzero()
    return int(hit[0]) if hit.numel() else None


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

    def __init__(self, model, name: str = "model", tokenizer=None, tree_width: int = 1) -> None:
        """tree_width: as a chain's bottom level, draft token trees of this many candidates per depth (its path and
        the next best tokens; Level.propose_tree); 1: paths."""
        super().__init__()
        self.model, self.name, self.tokenizer = model, name, tokenizer
        self.tree_width = check_tree_width(tree_width)
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
    def score(self, context: list[int], draft: list[int], sampling: SamplingConfig,
              parents: list[int] | None = None) -> Tensor:
        """parents: the draft is a token tree (models.tree, -1 for the context's children); the rows returned are
        then the distributions after the context and after each node [N+1, V], and keep_path must follow."""
        t0 = time.perf_counter()
        seq = context + draft
        start = self._start(context)
        c = self.counters
        dev = self.model.device
        if start == 0 and draft and (parents is not None or getattr(self.model, "dtype", None) in ROW_INVARIANT_DTYPES):
            # bf16/fp16: prefill the context alone, as vanilla decoding does, so its cached rows have
            # vanilla's exact bits (a prefill's rows change with its length in reduced precision); a tree after
            # the prompt too (a tree call is one compiled step)
            pre_logits, pre_hidden = self.model(torch.tensor([context], dtype=torch.long, device=dev), 0,
                                                last_only=True)  # [1, 1, V]
            logits, hidden = self.model(torch.tensor([draft], dtype=torch.long, device=dev), len(context),
                                        **_tree(parents))
            logits = torch.cat((pre_logits, logits), dim=1)  # [1, len(draft)+1, V]
            hidden = torch.cat((pre_hidden, hidden), dim=1)  # [1, len(seq), E]
            c.forwards += 1  # the extra forward is the prefill vanilla decoding runs too
        else:  # the LM head runs on the rows whose distributions are returned only (a prefill's last)
            fed = len(context) - start  # context rows of the call, then the draft's
            rows = None if parents is None else list(range(-1, fed - 1)) + [fed - 1 if a < 0 else fed + a
                                                                          for a in parents]
            logits, hidden = self.model(torch.tensor([seq[start:]], dtype=torch.long, device=dev), start,
                                        tail=len(draft) + 1, **_tree(rows))  # [1, len(draft)+1, V], [1, M, E]
        self.cached = seq if parents is None else list(context)  # a tree's nodes: see keep_path
        self.hidden, self.hidden_start = hidden[0], start
        self.logits = logits[0, -(len(draft) + 1):]  # [len(draft)+1, V] (confidence)
        probs = probs_from_logits(self.logits, sampling)  # [len(draft)+1, V]
        c.forwards += 1
        c.tokens_fed += len(seq) - start
        c.time_s += time.perf_counter() - t0
        return probs

    def room(self, context: list[int]) -> int:
        """The cache's rows after context, and a compiled step's rows less the context rows fed with the draft."""
        rows = self.model.max_seq_len - len(context)
        step = getattr(self.model, "max_step_rows", None)
        if step is not None:
            start = self._start(context)
            rows = min(rows, step - (0 if start == 0 else len(context) - start))  # score's prefill goes apart
        return max(0, rows)

    def _start(self, context: list[int]) -> int:
        """The first context position score feeds: after the cached prefix shared with context, but always >= 1
        context token so that the logits at the last context position (predicting draft[0]) are produced."""
        return min(common_prefix(self.cached, context), len(context) - 1)

    @torch.inference_mode()
    def keep_path(self, context: list[int], draft: list[int], parents: list[int], path: list[int]) -> None:
        """After score(context, draft, parents=...): keep the nodes `path` (root first) as the cached sequence after
        context, their K/V moved in place (Transformer.keep_path) and their features as `hidden`'s last rows."""
        n = len(context)
        self.model.keep_path(token_tree.path_slots(parents, path[-1] if path else -1, n), n)
        if self.hidden is not None:
            fed = n - self.hidden_start  # context rows the tree call fed
            keep = list(range(fed)) + [fed + j for j in path]
            self.hidden = self.hidden.index_select(0, torch.tensor(keep, device=self.hidden.device))
        self.cached = list(context) + [draft[j] for j in path]

    def draft(self, context: list[int], k: int, sampling: SamplingConfig, generator: torch.Generator | None,
              eos: frozenset[int], min_confidence: float = 0.0) -> tuple[list[int], Tensor, Tensor]:
        tokens: list[int] = []
        rows: list[Tensor] = []
        raw: list[Tensor] = []
        for _ in range(k):
            probs = self.score(context + tokens, [], sampling)[0]  # [V]
            tok = int(argmax(probs)) if sampling.greedy else int(sample(probs, generator))
            tokens.append(tok)
            rows.append(probs)
            raw.append(self.logits[0])
            if tok in eos or self.unsure(0, tok, probs, sampling, min_confidence):
                break
        if not rows:
            return tokens, torch.empty(0, self.vocab_size), torch.empty(0, self.vocab_size)
        return tokens, torch.stack(rows), torch.stack(raw)


def _tree(parents: list[int] | None) -> dict:
    """A model call's keyword for a token tree's rows (none for an ordinary call)."""
    return {} if parents is None else {"parents": parents}


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
                 vocab_size: int | None = None, tree_width: int = 1) -> None:
        """tree_width: draft token trees of what followed up to this many matches (propose_tree); 1: paths."""
        super().__init__()
        self.tree_width = check_tree_width(tree_width)

        check(min_ngram >= 1, "min_ngram", f"must be >= 1, got {min_ngram}", "use 1 or more")
        check(max_ngram >= min_ngram, "max_ngram", f"must be >= min_ngram ({min_ngram}), got {max_ngram}",
              "raise max_ngram")
        self.max_ngram, self.min_ngram, self.name, self.vocab_size = max_ngram, min_ngram, name, vocab_size
        self.device: torch.device | None = None  # where its one-hot rows are made (a Chain sets the target's)

    def lookup(self, context: list[int], k: int) -> list[int]:
        """The continuation (at most k tokens) of the latest earlier occurrence of the longest matching n-gram."""
        return next(iter(self.lookup_many(context, k, 1)), [])

    def lookup_many(self, context: list[int], k: int, width: int) -> list[list[int]]:
        """Up to `width` different continuations, best first: the longest n-grams' matches before shorter ones',
        the latest first; one that only repeats the start of a better one is skipped."""
        ctx = np.asarray(context, dtype=np.int64)
        n_ctx, out = len(ctx), []
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = ctx[n_ctx - n:]
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:n_ctx - 1], n)  # [n_ctx-n, n]
            hits = np.flatnonzero((windows == tail).all(axis=1))
            for h in hits[hits + n < n_ctx][::-1]:  # those with a continuation, the latest first
                cont = ctx[h + n:h + n + k].tolist()
                if not any(c[:len(cont)] == cont for c in out):
                    out.append(cont)
                    if len(out) == width:
                        return out
        return out

    def propose_tree(self, context: list[int], k: int, width: int, eos: frozenset[int],
                     sampling: SamplingConfig | None = None, generator: torch.Generator | None = None,
                     min_confidence: float = 0.0) -> tuple[list[int], list[int], Tensor]:
        """The continuations of lookup_many merged into a tree (shared starts once), the best one first: its nodes
        are 0..len-1, a path whose cache rows need no move when it is kept. One-hot distributions (deterministic;
        min_confidence does not apply: a lookup cannot tell its confidence)."""
        t0 = time.perf_counter()
        tokens: list[int] = []
        parents: list[int] = []
        for cont in self.lookup_many(context, k, width):
            graft(tokens, parents, cont, eos)
        self.counters.forwards += 1
        self.counters.time_s += time.perf_counter() - t0
        return tokens, parents, one_hot(tokens, self.vocab_size, self.device)

    def propose(self, context: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator | None, eos: frozenset[int],
                min_confidence: float = 0.0) -> tuple[list[int], Tensor]:
        t0 = time.perf_counter()
        tokens = self.lookup(context, k)
        for i, t in enumerate(tokens):
            if t in eos:
                tokens = tokens[:i + 1]
                break
        self.counters.forwards += 1
        self.counters.time_s += time.perf_counter() - t0
        return tokens, one_hot(tokens, self.vocab_size, self.device)


def graft(tokens: list[int], parents: list[int], path: list[int], eos: frozenset[int]) -> list[int]:
    """Merge `path` (tokens after the context, cut after an EOS) into the token tree (tokens, parents; -1: a child of
    the context), in place: the nodes it shares with the tree once (a node's children are distinct tokens), the rest
    appended, after the tree's nodes. -> the appended nodes' tokens."""
    node_of = {(p, t): j for j, (t, p) in enumerate(zip(tokens, parents))}  # (parent, token) -> node
    node, added = -1, []
    for t in path:
        if (node, t) not in node_of:
            node_of[node, t] = len(tokens)
            tokens.append(t)
            parents.append(node)
            added.append(t)
        node = node_of[node, t]
        if t in eos:
            break
    return added


def one_hot(tokens: list[int], vocab_size: int, device=None) -> Tensor:
    """The distributions of deterministic drafts: one row per token, all its mass on it [len, V]."""
    q = torch.zeros(len(tokens), vocab_size, device=device)  # [len, V]
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return q


def path_with_siblings(tokens: list[int], q: Tensor, logits: Tensor, width: int, greedy: bool,
                       generator: torch.Generator | None, columns: Tensor | None = None,
                       min_confidence: float = 0.0) -> tuple[list[int], list[int], Tensor]:
    """A drafted path, tokens [n] drawn one after another from q [n, V] (its raw logits [n, V'], whose columns are the
    target's tokens `columns`, None: all of them in order), as a token tree with up to width-1 siblings of a path
    token: leaves that try other tokens for that position, at every depth, or with a min_confidence > 0 only at the
    depths whose token the drafter gave less (Level.confidence; a path cut by that confidence ends at such a token):
    where it was sure, a sibling would cost a verification row for little. On Qwen2.5-Coder-1.5B @w4a8 with its EAGLE
    head at k 3 and confidence 0.6, siblings at every depth took the target 8-10% longer a verification for 2-5% more
    accepted tokens; one at the unsure depth alone 2-4% longer for 6.5% more (docs/results.md, token trees).
    Greedy: the next best tokens by the logits, one-hot (deterministic picks), ranked over the logits' own columns (an
    EAGLE head's 16,384, not the target's 151,936). Sampling: draws from q[d] without replacement after the path's
    token, each with the distribution it was drawn from given the earlier ones (q[d] less them, renormalized), as
    runtime.tree_verify's rule needs; which depths get siblings depends only on the drafter's own draws, so the
    verification stays exact.
    -> (tokens [N], parents [N]: the path's nodes 0..n-1 first, then the siblings; distributions [N, V])."""
    n = len(tokens)
    out, parents, rows = list(tokens), list(range(-1, n - 1)), [q]
    for d in range(n if width > 1 else 0):
        if greedy:  # over the logits' columns; the picks' rows one-hot in the target's vocabulary
            left, col = torch.softmax(logits[d].float(), -1), column_of(tokens[d], columns)  # [V']
        else:
            left, col = q[d].clone(), tokens[d]  # [V]
        if min_confidence > 0 and col is not None and float(left[col]) >= min_confidence:
            continue  # the drafter was sure of this position's token
        if col is not None:
            left[col] = 0
        for _ in range(width - 1):
            z = float(left.sum())
            if z <= 0:  # nothing else has mass (a top-p cut, or a reduced draft vocabulary)
                break
            c = int(argmax(left)) if greedy else int(sample(left / z, generator))
            tok = c if not greedy or columns is None else int(columns[c])
            row = one_hot([tok], q.shape[1], q.device)[0].to(q) if greedy else left / z  # [V]
            out.append(tok)
            parents.append(d - 1)
            rows.append(row[None])
            left[c] = 0
    return out, parents, torch.cat(rows)
