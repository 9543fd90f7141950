"""What the planner predicts for token trees against paths, from a profile of this machine: the target's
compiled T(M), each pair's acceptance on held-out prompts (the shipped Alpaca set's last records, never a
benchmark's), the chains ranked as the plan stage ranks them.

    python -m experiments.tree_plan --model qwen2.5-coder-1.5b@w4a8 --middle runs/qwen05/model.safetensors@w4a8 \
        --widths 1,2,4 --k 4 --threshold 4 --prompts 8

Levels: the target (compiled steps, as `chain-compiled` runs it), optionally a middle level (a chain spelling of one
level, compiled too), one n-gram level per width (`ngram:3` for 1, `ngram:3/W` above), and --drafters: other bottom
levels by their chain spelling (e.g. a model's path and its trees, `runs/qwen05/model.safetensors@w4a8` and
`runs/qwen05/model.safetensors@w4a8#2`), each under the target alone. Pairs: the target over every n-gram level and
every drafter; with a middle level, the target over it and it over every n-gram level. Prints each level's
T(M), each pair's tokens per verification (and mean tree size, rank rates), and the plan: every chain at k (tree
pairs are measured at k only) with its predicted tau and speedup over plain decoding; --json writes it all.
"""
from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> None:
    from polybasic.bench.predict import held_out_prompts
    from polybasic.planner.measure import build_profile
    from polybasic.planner.search import SearchSpace, plan, render_markdown
    from polybasic.quant.api import load_any_model
    from polybasic.runtime.chain import scored_rows
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.levels import ModelLevel, NGramLevel
    from polybasic.runtime.text import eos_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b@w4a8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--middle", default=None,
                   help="a middle level's chain spelling, e.g. runs/qwen05/model.safetensors@w4a8")
    p.add_argument("--widths", default="1,2,4")
    p.add_argument("--drafters", default="", help="comma-separated bottom levels under the target alone, by their "
                   "chain spelling (LEVEL#W: a tree of W candidates per depth)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threshold", type=int, default=4, help="the middle level's threshold")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts: the last records of alpaca-1000")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",")]
    lm = load_any_model(a.model, a.dtype, "cpu")
    target = ModelLevel(lm.model, "target", lm.tokenizer)
    ngrams = [NGramLevel(3, name="ngram:3" + (f"/{w}" if w > 1 else ""), tree_width=w) for w in widths]
    built = {"target": target}  # chain_builder's cache: the target level once
    middle = parse_chain(a.middle, lm, cache=built)[1] if a.middle else None
    drafters = [parse_chain(d, lm, cache=built)[1] for d in a.drafters.split(",") if d]
    models = [target] + ([middle] if middle else [])
    rows = scored_rows(a.k, [a.threshold] if middle else None, len(models) + 1, max(widths))
    widest = max([*widths, *(d.tree_width for d in drafters)])
    rows[0] = max(rows[0], a.k * widest + 1)  # the target verifies the widest tree too
    compile_levels(models + [ngrams[-1]] + drafters, 512, lm.gguf_file if lm.model.dtype == torch.float32 else None,
                   rows=rows, notify=print)
    prompts = held_out_prompts(lm.tokenizer, a.prompts)
    pairs = [(target, n) for n in ngrams + drafters]
    pairs += [(target, middle)] + [(middle, n) for n in ngrams] if middle else []
    profile = build_profile(models + ngrams + drafters, pairs, prompts, a.k, context=256, reps=5,
                            max_new_tokens=a.max_new_tokens, eos=eos_ids(lm.tokenizer))
    for lv in profile.levels:
        print(f"T(M) {lv.name}: " + ", ".join(f"{m}: {t:.1f}" for m, t in zip(lv.cost.tokens, lv.cost.time_ms)) + " ms")
    for pr in profile.pairs:
        ranks = ", ".join(f"{key} {acc / tried:.2f} of {tried}" for key, (acc, tried) in list(pr.by_rank.items())[:8])
        size = f"{pr.nodes:.1f} nodes, rank rates (depth:rank) {ranks}" if pr.tree_width > 1 else f"rate {pr.rate:.2f}"
        print(f"{pr.verifier} <- {pr.drafter}: {pr.mean_accepted_length:.2f} tokens a verification, {size}")
    result = plan(profile, SearchSpace(k_values=[a.k], thresholds=[a.threshold], max_levels=3))
    print(render_markdown(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"profile": profile.to_dict(), "plan": result.to_dict()}, f, indent=1)


if __name__ == "__main__":
    main()
