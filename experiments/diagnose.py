"""Drafter diagnostics, no training: how often an EAGLE head's drafts match its base's greedy tokens,
measured where a chain really drafts.

Teacher-forced agreement averaged over every answer position overstates what a chain gets: a
chain's draft starts right after the previous draft ended (rejected or fully accepted), where the
head reads the newest token (the base's correction) without the base's feature of it. Here, for
token sequences (prompt + an answer the base generated greedily):

- one base forward gives the exact features f_p and `EagleHead.unroll` drafts k steps ahead of
  every position at once, attending exactly as EagleLevel's drafting loop does. Its inputs are the
  sequence's own tokens: a draft token only counts while every earlier one matched, and then it IS
  the sequence's token, so the accepted prefix of every draft is exact.
- a draft starting at position s (the position of its first token, context x_0..x_{s-1}) reads, as
  in EagleLevel after a verification: head rows 0..s-2 on exact features (step 1 = anchor s-2), then
  its own predicted features (steps 2..k).
- "draft_start": the positions a 2-level greedy chain [target, head] drafts at, found by walking the
  answer like the chain (`walk`): the first answer token is the target's own, committed from its
  prefill (no draft); from the second on, draft min(k, budget left - 1) tokens, accept the matching
  prefix a, the next start is a+1 positions later. The walk's rounds are the chain's verifications
  one for one (its `LinkStats`), up to float rounding in near-ties (the chain computes the same rows in
  other chunks); the rates and the mean accepted length count the rounds that drafted (per draft, as
  `polybasic bench` reports a drafter's acceptance).
- "all": a draft at every answer position but the first (the teacher-forced average).

python -m experiments.diagnose --model SOURCE --dtype float32,bfloat16 --head PATH \
    --data ALPACA_JSON --prompts 20 --max-new-tokens 64   [--offset M] [--k 5] [--chain]
evaluates on the LAST --prompts records of the data (or those from --offset on), never on the
training prompts at the start of the file, with the base in each dtype generating its own answers.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from polybasic.errors import check

AT = ("draft_start", "all")


def accepted_prefix(row: Sequence[bool]) -> int:
    """How many leading draft tokens match."""
    n = 0
    for ok in row:
        if not ok:
            break
        n += 1
    return n


def walk(matches: Sequence[Sequence[bool]]) -> list[tuple[int, int]]:
    """(start, accepted length a+1) of each round of a 2-level greedy chain over one answer.

    matches[i][j]: whether the draft started at answer index i has the right token at depth j+1
    (len(matches[i]) is that draft's length). Index 0 is the target's own token, committed from its
    prefill: a round of length 1 without a draft. From index 1 on, a round accepts the matching prefix
    a and moves a+1 on (the a tokens plus the target's correction or bonus token)."""
    out, i = ([(0, 1)], 1) if matches else ([], 0)
    while i < len(matches):
        n = accepted_prefix(matches[i]) + 1
        out.append((i, n))
        i += n
    return out


def walk_draft_starts(matches: Sequence[Sequence[bool]]) -> list[int]:
    """The accepted lengths (a+1, tokens per verification) of the rounds of `walk`."""
    return [n for _, n in walk(matches)]


@dataclass
class SequenceDrafts:
    """The head's drafts at every answer position of one sequence."""

    rows: list[list[bool]]  # rows[i]: matches of the draft starting at answer index i
    truth: list[int]  # the answer's tokens
    base_agrees: int  # answer positions where the base's full-forward argmax is the answer's token


def _as_pair(seq) -> tuple[list[int], int]:
    if isinstance(seq, (tuple, list)) and len(seq) == 2 and isinstance(seq[1], int) and not isinstance(seq[0], int):
        return list(seq[0]), seq[1]
    return list(seq.tokens), int(seq.n_prompt)


@torch.inference_mode()
def sequence_drafts(base, head, tokens: list[int], n_prompt: int, k: int = 5,
                    max_new_tokens: int | None = None) -> SequenceDrafts:
    """Match rows of every draft start of one sequence (see the module docstring). max_new_tokens:
    the chain's budget (default the answer's length); it caps the drafts near the end as the chain
    does (min(k, budget left - 1))."""
    n_tok, p0 = len(tokens), n_prompt
    check(p0 >= 2, "sequence", f"has a {p0}-token prompt", "give prompts of 2 or more tokens")
    check(n_tok > p0, "sequence", "has no answer tokens", "append the base's greedy answer to the prompt")
    budget = n_tok - p0 if max_new_tokens is None else max_new_tokens
    check(budget >= n_tok - p0, "max_new_tokens", f"is {budget}, less than the answer's {n_tok - p0} tokens",
          "pass the budget the answers were generated with")
    head.bind(base)  # also: the base returns the layers this head reads
    if not head._cache_free():
        head.drop_caches()
    x = torch.tensor([tokens], dtype=torch.long, device=base.device)  # [1, T]
    base.setup_caches(n_tok, 1)
    logits, hidden = base(x, 0)  # [1, T, V], [1, T, E]
    base_top = logits[0].argmax(-1).tolist()  # [T]: row p predicts x_{p+1}
    feats = hidden[:, :-1].to(head.dtype)  # [1, T-1, E] f_p
    outs = head.unroll(x, feats, k)  # k x [1, T-1, E]: step j at anchor p predicts x_{p+j+1}
    pred = []
    for out in outs:
        top = head.logits(out[0]).argmax(-1)  # [T-1] (draft ids)
        pred.append((top if head.d2t is None else head.d2t[top]).tolist())

    def row(s: int, anchors) -> list[bool]:
        """The draft at position s; anchors(j) -> (step index, anchor) of depth j (1-based)."""
        n = max(0, min(k, budget - (s - p0) - 1, n_tok - s))
        out = []
        for j in range(1, n + 1):
            st, a = anchors(j)
            out.append(pred[st][a] == tokens[s + j - 1])
        return out

    rows = [row(s, lambda j, s=s: (j - 1, s - 2)) for s in range(p0, n_tok)]
    agrees = sum(base_top[p - 1] == tokens[p] for p in range(p0, n_tok))
    return SequenceDrafts(rows, tokens[p0:], agrees)


def summarize(drafts: Iterable[SequenceDrafts], k: int, at: str = "draft_start", d2t: Tensor | None = None) -> dict:
    """Rates over the draft starts (`at`="draft_start") or every answer position ("all")."""
    check(at in AT, "at", f"is {at!r}", f"use one of {', '.join(AT)}")
    vocab = None if d2t is None else set(d2t.tolist())
    lengths: list[int] = []
    step1 = [0, 0]  # hits, drafts with >= 1 token
    reach = [0] * (k + 1)  # reach[j]: drafts whose first j tokens matched and that drafted a depth j+1
    hit = [0] * (k + 1)  # hit[j]: ... and whose depth j+1 matched too
    covered, n_pos, n_seq, agrees, n_ans = 0, 0, 0, 0, 0
    for d in drafts:
        n_seq += 1
        agrees += d.base_agrees
        n_ans += len(d.truth)
        starts = [s for s, _ in walk(d.rows)] if at == "draft_start" else range(len(d.rows))
        for i in starts:
            r = d.rows[i]
            if i == 0 or not r:  # no draft: the target's own first token, or the budget's last
                continue
            a = accepted_prefix(r)
            lengths.append(a + 1)
            step1[0] += r[0]
            step1[1] += 1
            for j in range(min(a + 1, len(r))):
                reach[j] += 1
                hit[j] += r[j]
            if vocab is not None:
                covered += d.truth[i] in vocab
            n_pos += 1
    hist: dict[int, int] = {}
    for n in lengths:
        hist[n] = hist.get(n, 0) + 1
    return {"at": at, "k": k, "sequences": n_seq, "starts": len(lengths),
            "step1": step1[0] / step1[1] if step1[1] else None,
            "depth_rate": [hit[j] / reach[j] if reach[j] else None for j in range(k)],  # P(depth j+1 | 1..j matched)
            "mean_accepted_length": sum(lengths) / len(lengths) if lengths else 0.0,
            "histogram": dict(sorted(hist.items())),
            "draft_vocab_coverage": None if vocab is None else (covered / n_pos if n_pos else None),
            "base_agrees": agrees / n_ans if n_ans else None}


def draft_start_acceptance(base_model, head, sequences, k: int = 5, at: str = "draft_start",
                           max_new_tokens: int | None = None) -> dict:
    """The head's agreement with its base on `sequences` (each Sample-like, .tokens and .n_prompt,
    or a (tokens, n_prompt) pair: the prompt plus the base's GREEDY answer) at the draft starts of a
    2-level greedy chain (at="draft_start") or at every answer position (at="all").

    Returns {"step1": depth-1 agreement, "depth_rate": [P(depth j matches | depths < j matched)],
    "mean_accepted_length": mean a+1 per draft (for draft starts: the chain's, per draft),
    "histogram": {a+1: count}, "draft_vocab_coverage": share of the base's next tokens at those
    positions inside the head's draft vocabulary (None: full vocabulary), "base_agrees": share of
    answer tokens the base's one-forward argmax reproduces (1.0 unless numerics differ), "starts",
    "sequences", "at", "k"}. max_new_tokens: the budget the answers were generated with (it caps
    the last drafts as the chain does; default each answer's length)."""
    check(at in AT, "at", f"is {at!r}", f"use one of {', '.join(AT)}")
    drafts = [sequence_drafts(base_model, head, *_as_pair(s), k=k, max_new_tokens=max_new_tokens)
              for s in sequences]
    return summarize(drafts, k, at, head.d2t)


def diagnose(base_model, head, sequences, k: int = 5, max_new_tokens: int | None = None) -> dict[str, dict]:
    """Both reports, {"draft_start": ..., "all": ...}, from one pass over the sequences."""
    drafts = [sequence_drafts(base_model, head, *_as_pair(s), k=k, max_new_tokens=max_new_tokens)
              for s in sequences]
    return {at: summarize(drafts, k, at, head.d2t) for at in AT}


# -- command line -----------------------------------------------------------------------------------

def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _table(rows: list[tuple[str, str, dict, float | None]], k: int) -> str:
    head = ["dtype", "at", "starts", "step1", "tau"] + [f"d{j + 1}" for j in range(k)] + ["vocab_cov", "base_ok",
                                                                                        "chain_tau"]
    lines = [head]
    for dt, at, r, chain in rows:
        lines.append([dt, at, str(r["starts"]), _fmt(r["step1"]), _fmt(r["mean_accepted_length"])]
                     + [_fmt(x) for x in r["depth_rate"]]
                     + [_fmt(r["draft_vocab_coverage"]), _fmt(r["base_agrees"]), _fmt(chain)])
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in lines)


def main(argv=None) -> None:
    import copy

    from polybasic.data import DataSource
    from polybasic.drafters.data import load_pairs
    from polybasic.models.decoder import use_decode_layout
    from polybasic.models.eagle_head import load_head
    from polybasic.models.loader import parse_dtype
    from polybasic.models.preflight import default_dtype
    from polybasic.quant.api import load_any_model
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.text import encode_prompt, eos_ids

    ap = argparse.ArgumentParser(prog="python -m experiments.diagnose",
                                 description="An EAGLE head's acceptance at a greedy chain's draft starts.")
    ap.add_argument("--model", required=True, help="the base model (any polybasic model source, NAME@w4a8 too)")
    ap.add_argument("--dtype", default="float32", help="the base's dtype(s), comma-separated, e.g. float32,bfloat16")
    ap.add_argument("--head", required=True, help="head.safetensors")
    ap.add_argument("--data", required=True, help="Alpaca or ShareGPT records (a data source)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--offset", type=int, default=None,
                    help="first record used (negative: from the end); default the last --prompts records")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chain", action="store_true", help="also run the real 2-level greedy chain (its tau)")
    a = ap.parse_args(argv)
    check(a.prompts >= 1, "--prompts", f"must be >= 1, got {a.prompts}", "use e.g. 20")
    check(a.k >= 1, "--k", f"must be >= 1, got {a.k}", "use e.g. 5")
    lm = load_any_model(a.model, default_dtype(a.model), a.device)
    pairs = load_pairs(DataSource(a.data), None, "--data")
    off = len(pairs) - a.prompts if a.offset is None else (a.offset if a.offset >= 0 else len(pairs) + a.offset)
    chosen = pairs[max(0, off):max(0, off) + a.prompts]
    check(bool(chosen), "--offset", f"leaves no records of {len(pairs)}", "lower it")
    eos = eos_ids(lm.tokenizer)
    prompts = [encode_prompt(lm.tokenizer, q)[-a.max_prompt_tokens:] for q, _ in chosen]
    print(f"{a.model}: records {max(0, off)}..{max(0, off) + len(chosen) - 1} of {len(pairs)}, "
          f"k={a.k}, max_new_tokens={a.max_new_tokens}")
    rows = []
    for name in [d.strip() for d in a.dtype.split(",") if d.strip()]:
        dt = parse_dtype(name)
        base = lm.model if lm.model.dtype == dt else use_decode_layout(copy.deepcopy(lm.model).to(dt))
        head = load_head(a.head, base)
        seqs = [(ids + list(generate_tokens(base, ids, a.max_new_tokens, eos=eos)), len(ids)) for ids in prompts]
        rep = diagnose(base, head, seqs, a.k, a.max_new_tokens)
        chain_tau = None
        if a.chain:
            from polybasic.runtime.chain import Chain
            from polybasic.runtime.eagle_level import EagleLevel
            from polybasic.runtime.levels import ModelLevel

            acc = []
            for ids in prompts:
                ml = ModelLevel(base, "target")
                chain = Chain([ml, EagleLevel(head, ml)], k=a.k, eos=eos)
                _, st = chain.generate(ids, a.max_new_tokens)
                acc += [n for n, d in zip(st.links[0].accepted, st.links[0].drafted) if d]  # per draft
            head.drop_caches()
            chain_tau = sum(x + 1 for x in acc) / len(acc) if acc else None
        for at in AT:
            rows.append((name, at, rep[at], chain_tau if at == "draft_start" else None))
        hist = rep["draft_start"]["histogram"]
        print(f"{name}: draft-start accepted-length histogram {hist}")
    print(_table(rows, a.k))
    print("step1: depth-1 agreement; tau: mean accepted length (a+1); dJ: P(depth J matches | depths < J matched); "
          "vocab_cov: base tokens inside the draft vocabulary; base_ok: answer tokens the base's one-forward "
          "argmax reproduces; chain_tau: the real chain's mean accepted length per draft (--chain)")


if __name__ == "__main__":
    main()
