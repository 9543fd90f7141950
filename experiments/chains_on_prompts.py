"""Compiled chains side by side with compiled plain decoding on a data set's LAST prompts (never a benchmark's):
what tuning a chain (its k, a lookup, a tree) may look at. Each prompt runs every method in turn, so machine drift
hits them alike; tokens/s is new tokens / wall time over all prompts, tau new tokens per target forward.

python -m experiments.chains_on_prompts --model qwen2.5-coder-1.5b@w4a8 --data work-mix-48 --prompts 13 \
    --chains "eagle:runs/x/head.safetensors@w4a8:2,eagle:runs/x/head.safetensors@w4a8|ngram:3"

--chains: comma-separated SPEC:K (a chain spelling, then its k after the last ':').
"""
from __future__ import annotations

import argparse
import time

import torch

from polybasic.drafters.data import load_pairs
from polybasic.models.static import covering
from polybasic.quant.api import load_any_model
from polybasic.runtime.chain import Chain
from polybasic.runtime.chain_builder import parse_chain
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.text import encode_prompt, eos_ids


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--data", default="work-mix-48")
    ap.add_argument("--prompts", type=int, default=13)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chains", required=True)
    ap.add_argument("--sizes", default="1,2,4,6,8,64", help="compiled step sizes")
    a = ap.parse_args(argv)
    lm = load_any_model(a.model, a.dtype, "cpu")
    prompts = [encode_prompt(lm.tokenizer, q) for q, _ in load_pairs(a.data)[-a.prompts:]]
    eos, cache, chains = eos_ids(lm.tokenizer), {}, []
    longest = max(len(p) for p in prompts) + a.max_new_tokens + 1
    for item in a.chains.split(","):
        spec, _, k = item.rpartition(":")
        chain = Chain(parse_chain(spec, lm, cache=cache), k=int(k), eos=eos)
        sizes = covering(tuple(int(s) for s in a.sizes.split(",")), chain.scored_rows, lm.model.device)
        compile_levels(chain.levels, longest, lm.gguf_file, sizes, rows=chain.scored_rows,
                       lengths=[len(p) + a.max_new_tokens + 1 for p in prompts])
        chains.append((f"{spec} k={k}", chain))
    plain = "plain (compiled steps)"
    totals = {name: {"s": 0.0, "tokens": 0, "forwards": 0, "identical": 0} for name in [plain] + [n for n, _ in chains]}
    for ids in prompts:
        ref = None
        for name, chain in [(plain, None)] + chains:
            t0 = time.perf_counter()
            if chain is None:
                out = ref = list(generate_tokens(lm.model, ids, a.max_new_tokens, eos=eos))
                forwards = len(out)
            else:
                out, st = chain.generate(ids, a.max_new_tokens)
                forwards = len(st.links[0].accepted)
            t = totals[name]
            t["s"] += time.perf_counter() - t0
            t["tokens"] += len(out)
            t["forwards"] += forwards
            t["identical"] += out == ref
    base = totals[plain]["tokens"] / totals[plain]["s"]
    print(f"{a.model}, last {a.prompts} prompts of {a.data}, {a.max_new_tokens} tokens")
    print("| method | tokens/s | vs plain | tau | identical |\n|---|---|---|---|---|")
    for name, t in totals.items():
        t["tokens_per_s"] = t["tokens"] / t["s"]
        print(f"| {name.replace('|', chr(92) + '|')} | {t['tokens_per_s']:.2f} | {t['tokens_per_s'] / base:.3f}x | "
              f"{t['tokens'] / t['forwards']:.2f} | {t['identical']}/{len(prompts)} |")
    return totals


if __name__ == "__main__":
    main()
