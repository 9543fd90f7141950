"""What prompt lookup's continuation adds to a drafter's trees (`LEVEL|ngram`), by the length of the n-gram match it
continues: a greedy chain [target, drafter with lookup] over held-out prompts (never a benchmark's), every match
length let in (1 to --max-ngram), and per verification the lookup's extra nodes and the tokens the target kept from
them. Prints, per match length, the verifications, the lookup's nodes, the tokens they won (each a node and a
verification) and the share of verifications they won anything in; with no match, the drafter's path alone.

    python -m experiments.lookup_gain --model qwen2.5-coder-1.5b@w4a8 --drafter eagle:runs/head-cm.safetensors@w4a8 \
        --data work-mix-48 --last 12 --data alpaca-1000 --records 980:1000 --k 3
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from polybasic.runtime.levels import NGramLevel


def match_length(context: list[int], max_ngram: int) -> int:
    """The longest n <= max_ngram whose last n tokens occur earlier with a continuation (0: none): the n-gram the
    lookup continues, found by NGramLevel's own search at that n alone."""
    return next((n for n in range(max_ngram, 0, -1) if NGramLevel(n, min_ngram=n).lookup(context, 1)), 0)


def main(argv: list[str] | None = None) -> dict[int, list[int]]:
    from polybasic.config import DataSource
    from polybasic.drafters.data import load_pairs
    from polybasic.quant.api import load_any_model
    from polybasic.runtime import chain as chain_mod
    from polybasic.runtime import with_lookup
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.text import encode_prompt, eos_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--drafter", required=True, help="the drafting level (a --chain level), e.g. eagle:PATH@w4a8")
    p.add_argument("--data", action="append", required=True, help="a data set (repeatable), each with --last or "
                   "--records")
    p.add_argument("--last", action="append", type=int, default=[], help="a --data's last N prompts")
    p.add_argument("--records", action="append", default=[], help="a --data's records A:B")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-ngram", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args(argv)
    picks = [slice(-n, None) for n in a.last] + [slice(*map(int, r.split(":"))) for r in a.records]
    if len(picks) != len(a.data):
        p.error(f"{len(a.data)} --data but {len(picks)} --last/--records: give each data set one")
    lm = load_any_model(a.model, a.dtype, "cpu")
    eos = eos_ids(lm.tokenizer)
    texts = [q for d, s in zip(a.data, picks) for q, _ in list(load_pairs(DataSource(d)))[s]]
    target, drafter = parse_chain(a.drafter, lm)
    level = with_lookup.WithLookup(drafter, NGramLevel(a.max_ngram, min_ngram=1, name="ngram"))
    seen: dict = {}
    graft, verify = with_lookup.graft, chain_mod.verify_tree

    def spy_graft(tokens, parents, path, eos_):  # the drafter's nodes come first, then the lookup's
        seen["drafted"], seen["n"] = len(tokens), match_length(seen["context"], a.max_ngram)
        return graft(tokens, parents, path, eos_)

    def spy_propose(context, *args, _p=level.propose_tree):
        seen["context"] = context
        return _p(context, *args)

    stats = defaultdict(lambda: [0, 0, 0, 0])  # match length -> verifications, lookup nodes, tokens won, wins

    def spy_verify(tokens, parents, q, p_, greedy, generator=None):
        path, nxt = verify(tokens, parents, q, p_, greedy, generator)
        if not tokens:  # the budget's last token: nothing drafted
            return path, nxt
        row, first = stats[seen["n"]], seen["drafted"]
        won = sum(j >= first for j in path)
        row[0] += 1
        row[1] += len(tokens) - first
        row[2] += won
        row[3] += won > 0
        return path, nxt

    with_lookup.graft, chain_mod.verify_tree, level.propose_tree = spy_graft, spy_verify, spy_propose
    try:
        chain = Chain([target, level], k=a.k, eos=eos)
        for text in texts:
            chain.generate(encode_prompt(lm.tokenizer, text), a.tokens)
    finally:
        with_lookup.graft, chain_mod.verify_tree = graft, verify
    print(f"\n{len(texts)} prompts, {a.tokens} new tokens, greedy, k {a.k}; target {a.model}, {a.drafter}|ngram")
    print("| match | verifications | lookup nodes each | tokens won each | won a node | share won anything |")
    print("|---|---|---|---|---|---|")
    for n in sorted(stats):
        v, nodes, won, wins = stats[n]
        print(f"| {n or 'none'} | {v} | {nodes / v:.2f} | {won / v:.3f} | "
              f"{won / nodes if nodes else 0:.3f} | {wins / v:.3f} |")
    return dict(stats)


if __name__ == "__main__":
    main()
