"""Does a quantized copy pay for a reduced draft vocabulary (quantize.draft_vocab_size)? On the held-out prompts
of experiments.draft_stop (not Spec-Bench), greedy, 128 new tokens each:

    python -m experiments.draft_vocab --chain runs/qwen-p31/model.safetensors@w4a8+ngram --sizes 32768 --rounds 2

1. Coverage: how many of the target's own output tokens lie outside the N most frequent tokens of the quantize
   stage's calibration records (pipelines.quantize.draft_vocabulary over the default data, holdout excluded).
2. Speed: the chain with the copy's LM head whole, then trimmed to each N (quant.api.trim_lm_head), the levels
   below the target compiled, configs alternated per round; tokens/s, tau, the copy's forwards and ms each.
   Every run's tokens are checked against plain decoding's.
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    import torch

    from experiments.draft_stop import PROMPTS
    from polybasic.config import QuantizeSection
    from polybasic.pipelines.quantize import draft_vocabulary, load_records
    from polybasic.quant.api import load_any_model, read_quant_metadata, trim_lm_head
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.text import encode_prompt, eos_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chain", required=True, help="the levels below the target; the first is the quantized copy")
    p.add_argument("--sizes", default="16384,32768,65536", help="draft vocabulary sizes (multiples of 16)")
    p.add_argument("--coverage", default="8192,16384,32768,65536", help="sizes whose coverage is counted only")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--confidence", type=float, default=0.4)
    p.add_argument("--threshold", type=int, default=12)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    lm = load_any_model(a.model, a.dtype, "cpu")
    eos = eos_ids(lm.tokenizer)
    prompts = [encode_prompt(lm.tokenizer, text) for text in PROMPTS]
    refs = [list(generate_tokens(lm.model, x, a.tokens, eos=eos)) for x in prompts]
    q = QuantizeSection()
    records = load_records(q.data)[:-q.holdout]
    order = {n: draft_vocabulary(lm, records, n) for n in sorted({*sizes, *map(int, a.coverage.split(","))})}
    total = sum(len(r) for r in refs)
    print(f"coverage of the target's {total} output tokens on {len(prompts)} held-out prompts "
          f"(vocabulary {lm.args.vocab_size}):")
    for n, ids in order.items():
        keep = set(ids.tolist())
        print(f"  N={n}: {sum(t not in keep for r in refs for t in r)} outside")

    levels = parse_chain(a.chain, lm)
    model, path = levels[1].model, a.chain.split("+")[0].rpartition("@")[0] or a.chain.split("+")[0]
    cfg = read_quant_metadata(path)[0]
    head = model.output
    longest = max(len(x) for x in prompts) + a.tokens + 1
    print("| round | copy's vocabulary | tokens/s | tau | copy forwards | ms each | compile s |\n|---|---|---|---|---|---|---|")
    for rnd in range(a.rounds):
        for n in [0, *sizes]:
            model.output, model.draft_ids = head, None
            if n:
                trim_lm_head(model, order[n], cfg)
            torch._dynamo.reset()  # the head's shape changed: compile the steps again
            t_c = compile_levels(levels[1:], longest, None, [1, 2, 4, 64])
            chain = Chain(levels, k=a.k, thresholds=[a.threshold], eos=eos, draft_confidence=a.confidence)
            chain.generate(prompts[0], 16)  # untimed: first calls of each shape
            made = dt = verif = fwd = t_copy = 0
            for x, ref in zip(prompts, refs):
                t0 = time.perf_counter()
                out, st = chain.generate(x, a.tokens)
                dt += time.perf_counter() - t0
                assert out == ref, f"N={n}: tokens differ from plain decoding's"
                copy = next(lv for lv in st.levels if lv["name"] == levels[1].name)
                made, verif, fwd, t_copy = made + len(out), verif + st.target_forwards, fwd + copy["forwards"], \
                    t_copy + copy["time_s"]
            print(f"| {rnd} | {n or lm.args.vocab_size} | {made / dt:.2f} | {made / verif:.2f} | {fwd} | "
                  f"{1000 * t_copy / fwd:.1f} | {t_c:.0f} |", flush=True)


if __name__ == "__main__":
    main()
