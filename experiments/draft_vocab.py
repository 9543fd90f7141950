"""Does a larger draft vocabulary raise an eagle1 head's acceptance? The head's decoder predicts the base's last
feature and drafts over the base's LM head rows d2t, so the same trained head can draft over more rows: here the N
most frequent answer tokens of its distill samples for each N, on 4-bit weights, in a greedy [target, head] chain
over a data set's LAST prompts (eager; tau and step-1 acceptance per N, and the head's time a forward).

python -m experiments.draft_vocab --model qwen2.5-coder-1.5b@w4a8 --run runs/qwen2.5-coder-1.5b-w4a8 \
    --sizes 16384,32768,65536 --data work-mix-48 --prompts 13
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

from polybasic.drafters.data import load_pairs
from polybasic.models.eagle_head import frequent_tokens
from polybasic.quant.api import load_any_model, quantize_head
from polybasic.runtime.chain import Chain
from polybasic.runtime.chain_builder import parse_chain
from polybasic.runtime.text import encode_prompt, eos_ids


def widen(head, ids) -> None:
    """The head drafting over the rows `ids` [N] (any N) of its base's LM head: its d2t and config replaced."""
    head.register_buffer("d2t", ids.to(head.d2t.device))
    object.__setattr__(head, "cfg", dataclasses.replace(head.cfg, draft_vocab_size=len(ids)))
    object.__setattr__(head, "_rows", None)


def main(argv: list[str] | None = None) -> dict[int, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--run", required=True, help="a recipe's out_dir: distill/samples.jsonl, distill/target/head")
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--kernel", default="w4a8", help="the head's 4-bit kernel ('' : as trained)")
    ap.add_argument("--data", default="work-mix-48")
    ap.add_argument("--prompts", type=int, default=13)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args(argv)
    run = Path(a.run)
    lm = load_any_model(a.model, a.dtype, "cpu")
    samples = [SimpleNamespace(**json.loads(x)) for x in (run / "distill" / "samples.jsonl").read_text().splitlines()]
    prompts = [encode_prompt(lm.tokenizer, q) for q, _ in load_pairs(a.data)[-a.prompts:]]
    out = {}
    for n in (int(s) for s in a.sizes.split(",")):
        levels = parse_chain(f"eagle:{run / 'distill' / 'target' / 'head.safetensors'}", lm)
        widen(levels[-1].head, frequent_tokens(samples, n, lm.args.vocab_size))
        if a.kernel:
            quantize_head(levels[-1].head, a.kernel)
        chain = Chain(levels, k=a.k, eos=eos_ids(lm.tokenizer))
        tokens = rounds = first = forwards = 0
        head_s = 0.0
        for ids in prompts:
            new, st = chain.generate(ids, a.max_new_tokens)
            tokens += len(new)
            rounds += len(st.links[0].accepted)
            first += sum(x >= 1 for x in st.links[0].accepted)
            head_s, forwards = head_s + levels[-1].counters.time_s, forwards + levels[-1].counters.forwards
        out[n] = {"tau": tokens / rounds, "step1": first / rounds, "head_ms": head_s * 1e3 / max(1, forwards)}
        print(f"draft vocabulary {n}: tau {out[n]['tau']:.3f}, step-1 acceptance {out[n]['step1']:.3f}, "
              f"head {out[n]['head_ms']:.2f} ms a forward", flush=True)
    return out


if __name__ == "__main__":
    main()
