"""Where a compiled chain's time goes, beside compiled plain decoding, on a SmolLM2-shaped random model (no
download needed):

    python -m experiments.chain_profile --device cuda --out runs/chain-profile

The chain is the GPU bench's `chain-compiled:target@bfloat16+ngram` (an fp32 target, its bf16 copy, an n-gram
level; k 8, the copy's threshold 9). For each prompt (random tokens, 60-200 long, twice): tokens/s of plain
decoding and of the chain, tau, and whether the tokens are equal, once with the compiled steps skipping dynamo's
guards after a key's first pass (models.static.unguarded, the default) and once checking them at every call
(StaticSteps.skip_guards False). Then (unless --no-profile) one chain generation under cProfile
(the host's Python, by own time and by cumulative time) and under torch.profiler (host and device time per
op and per compiled graph: a graph's calls and device time say which level it is), and one plain decoding
under torch.profiler; all printed and written to OUT/profile.txt, the chain's trace to OUT/trace.json. Random
weights give loops that every level accepts, so tau is high and says nothing of a trained model: what this
measures is each level's cost per call and the host's share.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch


def main(argv=None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from experiments.graph_steps import smollm2_shaped
    from polybasic.models.static import StaticSteps
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.levels import ModelLevel, NGramLevel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M has 30")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", default="runs/chain-profile")
    p.add_argument("--no-profile", action="store_true", help="time the prompts only (no cProfile, no torch.profiler)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "profile.txt").open("w")

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    model = smollm2_shaped(a.device, a.layers)
    target, vanilla, copy = model(torch.float32), model(torch.float32), model(torch.bfloat16)
    name = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    say(f"device {name}, torch {torch.__version__}, {a.layers} layers")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 49000, (n,), generator=g).tolist() for n in (60, 120, 90, 200)]
    lengths = [len(q) + a.tokens + 1 for q in prompts]
    t0 = time.perf_counter()
    compile_levels([ModelLevel(vanilla)], max(lengths), lengths=lengths, decode=True)
    say(f"compile plain decoding {time.perf_counter() - t0:.1f} s")
    levels = [ModelLevel(target, "target"), ModelLevel(copy, "bf16"), NGramLevel(max_ngram=3, min_ngram=1)]
    t0 = time.perf_counter()
    compile_levels(levels, max(lengths), lengths=lengths)
    say(f"compile chain {time.perf_counter() - t0:.1f} s")
    chain = Chain(levels, k=8)

    for _ in range(2):
        for q in prompts:
            for skip in (True, False):  # compiled steps without and with dynamo's guards at every call
                StaticSteps.skip_guards = skip
                sync()
                t0 = time.perf_counter()
                plain = list(generate_tokens(vanilla, q, a.tokens))
                sync()
                t1 = time.perf_counter()
                tokens, stats = chain.generate(q, a.tokens)
                sync()
                t2 = time.perf_counter()
                calls = ", ".join(f"{ln.verifier}<-{ln.drafter} {len(ln.drafted)} calls {sum(ln.accepted)} accepted"
                                  for ln in stats.links)
                say(f"prompt {len(q)}, guards {'skipped' if skip else 'checked'}: plain {len(plain) / (t1 - t0):7.1f} "
                    f"tokens/s, chain {len(tokens) / (t2 - t1):7.1f} tokens/s, tau {stats.tau:.2f}, equal "
                    f"{plain == tokens} ({calls})")
    StaticSteps.skip_guards = True
    if a.no_profile:
        return

    prof = cProfile.Profile()
    prof.enable()
    chain.generate(prompts[1], a.tokens)
    sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
        say(text.getvalue())
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as prof:
        chain.generate(prompts[1], a.tokens)
        sync()
    say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    prof.export_chrome_trace(str(out / "trace.json"))
    with profile(activities=acts) as prof:
        list(generate_tokens(vanilla, prompts[1], a.tokens))
        sync()
    say(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
