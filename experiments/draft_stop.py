"""Sweep of draft lengths, thresholds and --draft-confidence for one chain, on held-out prompts (not
Spec-Bench), with the levels below the target compiled once and the target eager (--compile-target: compiled too,
as `generate --compile` runs a bundle):

    python -m experiments.draft_stop --model qwen2.5-coder-1.5b --dtype bfloat16 \
        --chain runs/qwen-p31/model.safetensors --configs 8:0/16:0.5/24:0.6 --vanilla
    python -m experiments.draft_stop --model qwen2.5-coder-1.5b@w4a8 --chain eagle:runs/head-cm.safetensors@w4a8 \
        --configs 2:0/3:0.7 --compile-target --sizes 1,2,4,6,8,64 --prompts work-mix-48 --limit 12 --vanilla

A config is K:CONFIDENCE[:THRESHOLD,...] (Chain's k, draft_confidence and thresholds), configs separated
by "/". Several chains compare side by side: repeat --chain, each followed by its own --configs (levels that
two chains share are loaded once). --prompts: the last --limit prompts of a data set (a shipped name or an Alpaca
JSON file; never a benchmark's) instead of the four below. Prints tokens/s per config over the prompts (greedy, 128 new tokens each,
prefill included), with tau and each level's forwards, tokens fed and seconds, and checks that every config's
tokens are the target's (vanilla's, when --vanilla runs it). --prefill: the prompts' prefills alone, in seconds.
"""
from __future__ import annotations

import argparse
import time

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain the difference between a list and a tuple in Python, with a short example of each.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h and in m/s? Show the steps.",
    "Write a C function that reverses a singly linked list in place, and explain how it works.",
)


def parse_config(text: str) -> tuple[int, float, list[int] | None]:
    k, conf, *rest = text.split(":")
    return int(k), float(conf), [int(t) for t in rest[0].split(",")] if rest else None


def main(argv=None) -> None:
    from polybasic.config import DataSource
    from polybasic.drafters.data import load_pairs
    from polybasic.quant.api import load_any_model
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.text import encode_prompt, eos_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chain", required=True, action="append",
                   help="the levels below the target (polybasic generate --chain); repeat to compare chains")
    p.add_argument("--configs", required=True, action="append",
                   help="K:CONFIDENCE[:THRESHOLDS] separated by '/'; e.g. 8:0/16:0.5 (one --configs per --chain)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--sizes", default="1,2,4,64", help="step sizes the levels below the target compile")
    p.add_argument("--eager", action="store_true", help="do not compile the levels below the target")
    p.add_argument("--vanilla", action="store_true", help="time plain decoding of the target too")
    p.add_argument("--compile-target", action="store_true", help="compile the target's steps too (plain decoding's "
                   "as well): the chains as `generate --bundle --compile` runs them")
    p.add_argument("--prompts", help="a data set's last --limit prompts instead of the built-in four (e.g. "
                   "work-mix-48, the profile's held-out prompts)")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--prefill", action="store_true", help="also time each prompt's prefill alone (the target's "
                   "forward over the prompt and its first token, which plain decoding and every chain pay)")
    a = p.parse_args(argv)
    if len(a.configs) != len(a.chain):
        p.error(f"{len(a.chain)} --chain but {len(a.configs)} --configs: give each chain its own --configs")
    lm = load_any_model(a.model, a.dtype, "cpu")
    eos = eos_ids(lm.tokenizer)
    texts = PROMPTS if a.prompts is None else [q for q, _ in load_pairs(DataSource(a.prompts))][-a.limit:]
    prompts = [encode_prompt(lm.tokenizer, text) for text in texts]
    shared: dict = {}  # levels built once for every chain that names them
    chains = {spec: parse_chain(spec, lm, cache=shared) for spec in a.chain}
    configs = [(spec, *parse_config(c)) for spec, cs in zip(a.chain, a.configs) for c in cs.split("/")]
    if not a.eager:
        longest = max(len(x) for x in prompts) + a.tokens + 1
        below = list({id(lv): lv for levels in chains.values() for lv in levels[1:]}.values())
        levels, gguf = ([next(iter(chains.values()))[0], *below], lm.gguf_file) if a.compile_target else (below, None)
        seconds = compile_levels(levels, longest, gguf, [int(s) for s in a.sizes.split(",")],
                                 lengths=[len(x) + a.tokens + 1 for x in prompts])
        print(f"compiled in {seconds:.1f} s")
    for spec, k, conf, th in configs:  # untimed: a first call of a shape (oneDNN primitives, dynamo guards) is slower
        Chain(chains[spec], k=k, thresholds=th, eos=eos, draft_confidence=conf).generate(prompts[0], 16)
    rows, prefill_s = {}, 0.0
    for x in prompts:  # configs interleaved per prompt: drifts of the machine hit all alike
        ref = None
        if a.prefill:
            t0 = time.perf_counter()
            list(generate_tokens(lm.model, x, 1, eos=eos))
            prefill_s += time.perf_counter() - t0
        if a.vanilla:
            t0 = time.perf_counter()
            ref = list(generate_tokens(lm.model, x, a.tokens, eos=eos))
            rows.setdefault("vanilla", []).append((len(ref), time.perf_counter() - t0, len(ref), {}))
        for spec, k, conf, th in configs:
            chain = Chain(chains[spec], k=k, thresholds=th, eos=eos, draft_confidence=conf)
            t0 = time.perf_counter()
            out, st = chain.generate(x, a.tokens)
            dt = time.perf_counter() - t0
            name = f"k={k} confidence={conf} thresholds={th}" + (f" {spec}" if len(chains) > 1 else "")
            assert ref is None or out == ref, f"{name}: tokens differ from vanilla's"
            forwards = {lv["name"]: (lv["forwards"], lv["tokens_fed"], lv["time_s"]) for lv in st.levels}
            rows.setdefault(name, []).append((len(out), dt, st.target_forwards, forwards))
    print(f"\n{len(prompts)} prompts, {a.tokens} new tokens, greedy; target {a.model} {a.dtype}, "
          f"chain{'s' if len(chains) > 1 else ''} {', '.join(a.chain)}")
    print("| config | tokens/s | tau | per level: forwards, tokens fed, seconds |\n|---|---|---|---|")
    for name, r in rows.items():
        n, dt, tf = sum(x[0] for x in r), sum(x[1] for x in r), sum(x[2] for x in r)
        sums = {lv: [round(sum(x[3][lv][i] for x in r), 2) for i in range(3)] for lv in r[0][3]}
        levels = "; ".join(f"{lv}: {f} / {t} / {s} s" for lv, (f, t, s) in sums.items())
        print(f"| {name} | {n / dt:.2f} | {n / tf:.2f} | {levels or '-'} |")
    if a.prefill:
        print(f"| prefill alone | {prefill_s:.2f} s for {len(prompts)} prompts | - | - |")


if __name__ == "__main__":
    main()
