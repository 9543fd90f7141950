"""Eager against compiled static-shape steps (CUDA graphs on CUDA) on a SmolLM2-shaped random model, no
download needed:

    python -m experiments.graph_steps --device cuda --sizes 1,16 --tokens 128 --dtypes float32

For each dtype: greedy tokens/s of a 100-token prompt + --tokens new tokens, eager and compiled (second
run of each; compile + warm-up time apart), how many compiled tokens equal the eager ones; compiled decoding
with the host reading each token before the next step is queued ("sync") and after ("lookahead", CUDA's
default), alternating for --rounds; T(M) per step size (median of 20 forwards at position 200, each
waited for) and the same steps queued back to back (20 forwards, one wait: what the device alone or the
host alone allows, whichever is slower); and inductor's counters (cudagraph_skips: steps that did not
become CUDA graphs). Speed does not depend on the weights, so a random model times the real one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def smollm2_shaped(device: str, layers: int = 30):
    """A function dtype -> a prepared random model of SmolLM2-135M's shapes (`layers` of its 30) on `device`, every
    call with the same weights."""
    from polybasic.models.args import ModelArgs
    from polybasic.models.decoder import Transformer
    from polybasic.models.prepare import prepare_for_device

    args = ModelArgs(vocab_size=49152, dim=576, n_layers=layers, n_heads=9, n_kv_heads=3, head_dim=64,
                     intermediate_size=1536, max_seq_len=2048, tie_embeddings=True)
    torch.manual_seed(0)
    weights = Transformer(args).state_dict()

    def model(dtype: torch.dtype):
        m = Transformer(args).to(device, dtype).eval().requires_grad_(False)
        m.load_state_dict(weights)
        return prepare_for_device(m)
    return model


def main(argv=None) -> None:
    from torch._dynamo.utils import counters

    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.levels import ModelLevel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", default="1,16", help="step sizes to compile, 1 first")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=3, help="alternating sync / lookahead decodes")
    a = p.parse_args(argv)
    sizes = tuple(int(s) for s in a.sizes.split(","))
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    prompt = [(7 * i) % 40000 + 5 for i in range(100)]
    model = smollm2_shaped(a.device)

    def decode(m, ahead=None):
        sync()
        t0 = time.perf_counter()
        out = list(generate_tokens(m, prompt, a.tokens, lookahead=ahead))
        sync()
        return out, len(out) / (time.perf_counter() - t0)

    def step_ms(m, size):
        x = torch.zeros(1, size, dtype=torch.long, device=a.device)
        ts = []
        with torch.inference_mode():
            m.setup_caches(512)
            for _ in range(25):
                sync()
                t0 = time.perf_counter()
                m(x, 200)
                sync()
                ts.append(time.perf_counter() - t0)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                m(x, 200)
            sync()
        return f"{1e3 * statistics.median(ts[5:]):.2f} ({1e3 * (time.perf_counter() - t0) / 20:.2f} queued)"

    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        eager, compiled = model(dtype), model(dtype)
        ref, _ = decode(eager)
        _, eager_tps = decode(eager)
        ready_s = compile_levels([ModelLevel(compiled)], 512, sizes=sizes, flag="--sizes")
        decode(compiled)
        out, tps = decode(compiled)
        same = sum(x == y for x, y in zip(ref, out))
        print(f"{a.device} {name}: eager {eager_tps:.1f} tok/s, compiled {tps:.1f} tok/s (ready in {ready_s:.1f} s);"
              f" {same}/{len(ref)} tokens as eager")
        rates = {False: [], True: []}
        for _ in range(a.rounds):
            for ahead in (False, True):
                got, r = decode(compiled, ahead)
                assert got == out, "lookahead changed the tokens"
                rates[ahead].append(r)
        print("  compiled tok/s, sync: " + " ".join(f"{r:.1f}" for r in rates[False])
              + "; lookahead: " + " ".join(f"{r:.1f}" for r in rates[True]))
        print("  T(M) ms eager / compiled: " + ", ".join(
            f"M={s}: {step_ms(eager, s)} / {step_ms(compiled, s)}" for s in sizes))
        print("  inductor:", {k: v for k, v in counters["inductor"].items() if "graph" in k})


if __name__ == "__main__":
    main()
