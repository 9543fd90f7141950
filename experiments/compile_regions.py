"""Compiled steps as one graph of the whole model against one graph per layer (models.static regions), side by side.

    python -m experiments.compile_regions --model qwen2.5-coder-1.5b@w4a8 --dtype bfloat16 --sizes 1,2,4,6,64

1. Compile time, cold and warm, per mode: each mode compiles in a child process of its own with an empty inductor
   cache (cold), then again with that cache (warm); the steps' first calls are timed (compile and one run), and
   the graphs dynamo made are counted.
2. Steady time per step: both modes in one process, their steps called alternately (a step of each size at the
   same position, rolled back), median of --reps; and whether their logits are bit-equal. With --wrapped, each mode
   also with its steps called through dynamo's and AOT autograd's wrappers (StaticSteps.skip_wrappers False) beside
   its straight calls (models.static.GraphCall); the variants' order is shuffled each repetition.
Prints a markdown table; --json writes the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from polybasic.models.prepare import inductor_options
from polybasic.quant.api import load_any_model

WHOLE = "whole"


def modes(spans: list[int]) -> list[str]:
    """'whole', then 'regions:N' per N layers a region."""
    return [WHOLE, *(f"regions:{n}" for n in spans)]


def _load(model: str, dtype: str):
    lm = load_any_model(model, dtype, "cpu")
    return lm, lm.gguf_file if lm.model.dtype == torch.float32 else None  # fp32 steps read the GGUF's codes


def _compile(model, gguf, sizes, mode: str, length: int) -> tuple[float, int]:
    """Compile and warm every size in `mode`; (seconds, graphs dynamo compiled)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    if mode != WHOLE:
        model.layers_per_region = int(mode.split(":")[1])
    model.compile_steps(gguf, inductor_options("cpu"), sizes, lambda _: None, regions=mode != WHOLE)
    model.setup_caches(length)
    model.warm_steps()
    return time.perf_counter() - t0, counters["stats"]["unique_graphs"] - before


def child(a: argparse.Namespace) -> None:
    """One mode's compile, printed as JSON (run in a fresh process per mode and cache)."""
    lm, gguf = _load(a.model, a.dtype)
    seconds, graphs = _compile(lm.model, gguf, a.sizes, a.child, a.length)
    print(json.dumps({"seconds": seconds, "graphs": graphs}))


def compile_times(a: argparse.Namespace, caches: dict[str, str]) -> dict:
    """Each mode compiled cold in a child process with an empty inductor cache of its own (caches[mode]), then warm
    in another with that cache."""
    out = {}
    for mode in caches:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=caches[mode])
        cmd = [sys.executable, "-m", "experiments.compile_regions", "--model", a.model, "--dtype", a.dtype,
               "--sizes", ",".join(map(str, a.sizes)), "--length", str(a.length), "--child", mode]
        runs = [json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                           .stdout.strip().splitlines()[-1]) for _ in ("cold", "warm")]
        out[mode] = {"cold_s": runs[0]["seconds"], "warm_s": runs[1]["seconds"], "graphs": runs[0]["graphs"]}
    return out


@torch.inference_mode()
def steady(a: argparse.Namespace, caches: dict[str, str]) -> dict:
    """Every mode's steps in one process (compiled from the caches the children left), alternated."""
    models = {}
    for mode in (reversed(list(caches)) if a.reverse else caches):  # the order the models load in
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = caches[mode]
        lm, gguf = _load(a.model, a.dtype)
        _compile(lm.model, gguf, a.sizes, mode, a.length)
        models[mode] = lm.model
    vocab = models[WHOLE].args.vocab_size
    ids = torch.randint(0, vocab, (1, a.prompt + max(a.sizes)), generator=torch.Generator().manual_seed(0))
    p = a.prompt
    for m in models.values():
        m(ids[:, :p], 0)
    rows = [s for s in a.sizes if s <= 16]
    variants = [(mode, True) for mode in models] + ([(mode, False) for mode in models] if a.wrapped else [])
    times = {(v, r): [] for v in variants for r in rows}
    equal = {r: True for r in rows}
    shuffle = random.Random(0).shuffle
    for _ in range(a.reps):
        shuffle(variants)
        for r in rows:
            outs = {}
            for mode, straight in variants:
                m = models[mode]
                m._static.skip_wrappers = straight
                t0 = time.perf_counter()
                outs[mode, straight] = m(ids[:, p:p + r], p)[0]
                times[(mode, straight), r].append(time.perf_counter() - t0)
            equal[r] &= all(torch.equal(outs[WHOLE, True], o) for o in outs.values())
    return {r: {**{_name(mode, straight): 1e3 * statistics.median(times[(mode, straight), r])
                   for mode, straight in sorted(variants)}, "bit_equal": equal[r]} for r in rows}


def _name(mode: str, straight: bool) -> str:
    return f"{mode}{'' if straight else ' wrapped'}_ms"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b@w4a8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sizes", default="1,2,4,6,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--length", type=int, default=512, help="the caches' length")
    p.add_argument("--prompt", type=int, default=200, help="tokens before the timed steps")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--reverse", action="store_true", help="load the region modes' models before the whole one's")
    p.add_argument("--spans", default="1", type=lambda s: [int(x) for x in s.split(",")],
                   help="layers per compiled region, one mode each (beside the whole model's graph)")
    p.add_argument("--wrapped", action="store_true", help="also time each mode's steps through torch.compile's "
                   "wrappers (no straight calls)")
    p.add_argument("--steady-only", action="store_true", help="skip the cold and warm compile times (the steady "
                   "steps still compile, into a temporary cache)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a)
    with tempfile.TemporaryDirectory() as root:
        caches = {mode: os.path.join(root, mode.replace(":", "-")) for mode in modes(a.spans)}
        compiled = {} if a.steady_only else compile_times(a, caches)
        steps = steady(a, caches)
    print(f"{a.model} ({a.dtype}), sizes {a.sizes}, {torch.get_num_threads()} threads\n")
    if compiled:
        print("| mode | compile cold | compile warm | graphs |\n|---|---|---|---|")
        for mode, c in compiled.items():
            print(f"| {mode} | {c['cold_s']:.1f} s | {c['warm_s']:.1f} s | {c['graphs']} |")
    ref = _name(WHOLE, True)
    names = [k for k in next(iter(steps.values())) if k.endswith("_ms") and k != ref]
    print(f"\n| rows | whole | {' | '.join(n[:-3] for n in names)} | logits bit-equal |\n"
          f"|---|---|{'---|' * len(names)}---|")
    for r, s in steps.items():
        cells = " | ".join(f"{s[n]:.2f} ms ({s[n] / s[ref]:.3f}x)" for n in names)
        print(f"| {r} | {s[ref]:.2f} ms | {cells} | {s['bit_equal']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"compile": compiled, "steps": steps}, f, indent=1)


if __name__ == "__main__":
    main()
