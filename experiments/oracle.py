"""The runtime's efficiency, not the drafter's: a chain whose drafter is an oracle with a set acceptance, measured
against the planner's prediction for the same acceptance and costs, on random-weight models of real shapes.

    python -m experiments.oracle --shape qwen2.5-1.5b --rates 0.6,0.8,0.9 --widths 1,2,3 --new-tokens 128

OracleLevel drafts the target's own greedy continuation (a plain-decoding run of the same prompt): at each depth
its candidate of rank r (r < width) is the true token with probability rates[r] given that the ranks before it were
not (the others are wrong tokens), always k deep and width wide (k * width nodes, the shape the planner prices);
each proposal runs a random-weight block once per depth: a set cost. So the accepted length per verification is a
capped geometric variable with the per-depth rate 1 - prod(1 - rates[r]) (Theorem 3.3) and the planner's
measured-curve model (planner.cost.predict) predicts the chain's speed from the target's measured T(M), the
block's time and that rate alone. Measured / predicted is the runtime's efficiency: what the chain's own
bookkeeping, K/V moves and host work cost. The planner chooses from T(M) measured once at the start; each
chosen config's prediction is then made again from T(1) and T(M) measured before each prompt's runs and after the
last, averaged. Per rate:
the planned path (width 1, the best k) and the planned tree
(the best width and k), each generated on --prompts random prompts, greedy, its tokens checked against plain
decoding's, its time against compiled plain decoding's on the same prompts, the two alternated per prompt (prefill
included in both).
The prediction amortises the prompt's prefill over the new tokens, as the measurement includes it; a generation's
last verifications, cut by its budget, are not modelled (a few percent of tau at 256 tokens). Never a bundle's level:
it reads the answer.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from polybasic.config import SamplingConfig
from polybasic.planner.cost import ChainConfig, predict
from polybasic.planner.profile import CostCurve, LevelProfile, PairProfile, Profile
from polybasic.planner.theory import accepted_length_pmf
from polybasic.runtime.levels import Level, one_hot

# real models' shapes (their config.json), random weights: speed does not depend on the values
SHAPES = {
    "smollm2-135m": dict(family="llama", dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
                         vocab_size=49152, rope_theta=1e5, norm_eps=1e-5, tie_embeddings=True, qkv_bias=False),
    "qwen2.5-1.5b": dict(family="qwen2", dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_size=8960,
                         vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True),
    "llama-3.1-8b": dict(family="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                         vocab_size=128256, rope_theta=5e5, norm_eps=1e-5, tie_embeddings=False, qkv_bias=False),
    "tiny": dict(family="qwen2", dim=128, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=256,
                 vocab_size=512, rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True, qkv_bias=True),
}


class OracleLevel(Level):
    """Drafts `reference` (prompt + the target's greedy tokens) with per-rank acceptance `rates` (see the module's
    docstring); `block()` runs once per drafted depth. Greedy chains only."""

    def __init__(self, reference: list[int], rates: list[float], width: int = 1, block=None, seed: int = 0,
                 name: str = "oracle", vocab_size: int | None = None) -> None:
        super().__init__()
        self.reference, self.rates, self.tree_width = list(reference), list(rates), width
        self.block, self.name, self.vocab_size = block, name, vocab_size
        self.g = torch.Generator().manual_seed(seed)
        self.device: torch.device | None = None

    def _depths(self, context: list[int], k: int) -> list[tuple[list[int], int | None]]:
        """Per depth (at most k, within the reference): its candidates and the rank of the true token (None: no
        candidate is, and the rest of the draft follows rank 0)."""
        if context != self.reference[:len(context)]:
            return []
        out = []
        for d in range(min(k, len(self.reference) - len(context))):
            true = self.reference[len(context) + d]
            wrong = [(true + 1 + j) % self.vocab_size for j in range(self.tree_width)]
            rank = next((r for r in range(self.tree_width)
                         if float(torch.rand((), generator=self.g)) < self.rates[min(r, len(self.rates) - 1)]), None)
            if rank is not None:
                wrong[rank] = true
            out.append((wrong, rank))
            if self.block is not None:
                self.block()
        return out

    def propose(self, context, k, sampling, generator, eos, min_confidence=0.0):
        t0 = time.perf_counter()
        tokens = [cands[0] for cands, _ in self._depths(context, k)]
        self.counters.forwards += 1
        self.counters.time_s += time.perf_counter() - t0
        return tokens, one_hot(tokens, self.vocab_size, self.device)

    def propose_tree(self, context, k, width, eos, sampling=None, generator=None, min_confidence=0.0):
        """Each depth's candidates under the previous depth's true one (or its rank 0 where none was)."""
        t0 = time.perf_counter()
        tokens, parents, above = [], [], -1
        for cands, rank in self._depths(context, k):
            first = len(tokens)
            tokens += cands
            parents += [above] * len(cands)
            above = first + (rank or 0)
        self.counters.forwards += 1
        self.counters.time_s += time.perf_counter() - t0
        return tokens, parents, one_hot(tokens, self.vocab_size, self.device)


def depth_rate(rates: list[float], width: int) -> float:
    """The probability that some candidate of a depth is the true token."""
    return 1 - math.prod(1 - rates[min(r, len(rates) - 1)] for r in range(width))


def oracle_pair(rates: list[float], width: int, k: int, name: str) -> PairProfile:
    """The exact pair profile of an oracle level: geometric tokens per verification at depth_rate, k * width nodes."""
    a = depth_rate(rates, width)
    pmf = accepted_length_pmf(a, k)  # tokens per verification 1..k+1
    hist = {n: max(1, round(p * 1e9)) for n, p in enumerate(pmf, start=1)}
    return PairProfile("target", name, k, 10 ** 9, sum(n * p for n, p in enumerate(pmf, start=1)), a,
                       histogram=hist if width > 1 else {}, tree_width=width, sizes={k * width: 1} if width > 1 else {})


def plan_oracle(target: CostCurve, block_ms: float, rates: list[float], widths, ks,
                new_tokens: int | None = None) -> list[tuple]:
    """Every (width, k) predicted: (speedup, width, k, Prediction), best first; new_tokens: the prefill amortised
    over that many tokens (planner.cost.predict), None: steady state."""
    out = []
    for w in widths:
        for k in ks:
            name = f"oracle/{w}"
            drafter = CostCurve(list(range(1, max(ks) + 1)), [m * block_ms for m in range(1, max(ks) + 1)])
            prof = Profile("target", [LevelProfile("target", "model", target), LevelProfile(name, "ngram", drafter)],
                           [oracle_pair(rates, w, k, name)])
            pred = predict(prof, ChainConfig(("target", name), k), new_tokens)
            out.append((pred.speedup, w, k, pred))
    return sorted(out, key=lambda t: -t[0])


def build(shape: str, seed: int = 0, max_seq_len: int = 4096):
    """A random-weight bf16 lean decoder of `shape`, prepared for the CPU as a loaded model is."""
    from polybasic.models.args import ModelArgs
    from polybasic.models.decoder import Transformer
    from polybasic.models.prepare import prepare_for_device

    s = SHAPES[shape]
    args = ModelArgs(head_dim=s["dim"] // s["n_heads"], max_seq_len=max_seq_len, **s)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Transformer(args)
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():  # matrices N(0, 0.02) as the models were initialised, norms 1, biases 0
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in name else 0.0)
    return prepare_for_device(model.eval().requires_grad_(False))


def interleaved(makers, prompts, between=lambda: None) -> list[tuple[float, list[list[int]], list]]:
    """Each maker (prompt -> (new tokens, stats or None)) on every prompt, the makers alternated per prompt (the VM's
    speed drifts over minutes), `between()` called before each prompt's runs: per maker (seconds over all prompts,
    prefill included; each prompt's tokens; stats)."""
    out = [[0.0, [], []] for _ in makers]
    for p in prompts:
        between()
        for slot, make in zip(out, makers):
            t0 = time.perf_counter()
            toks, st = make(p)
            slot[0] += time.perf_counter() - t0
            slot[1].append(toks)
            slot[2].append(st)
    return [tuple(slot) for slot in out]


def main(argv=None) -> None:
    from polybasic.models.prepare import compile_for_device
    from polybasic.planner.measure import cost_curve
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.levels import ModelLevel

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    p.add_argument("--rates", default="0.6,0.8,0.9", help="per-rank acceptance, one run each (every rank the same)")
    p.add_argument("--widths", default="1,2,3", help="tree widths the planner chooses from (1: a path)")
    p.add_argument("--ks", default="1,2,3,4,5,6", help="draft depths the planner chooses from")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--block", type=int, default=512, help="the oracle's cost: a [N, N] bf16 matmul per depth")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rates, widths, ks = ([float(x) for x in a.rates.split(",")], [int(x) for x in a.widths.split(",")],
                         [int(x) for x in a.ks.split(",")])
    model = build(a.shape)
    rows = max(widths) * max(ks) + 1
    sizes = tuple(sorted({1, 2, 4, 8, 12, 16, rows, 64}))
    t0 = time.perf_counter()
    compile_for_device(model, sizes=sizes)
    model.setup_caches(a.prompt_len + a.new_tokens + 2)
    with torch.inference_mode():
        model.warm_steps()
    print(f"compiled {sizes} in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, model.args.vocab_size, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    plain = lambda pr: (list(generate_tokens(model, pr, a.new_tokens, eos=set())), None)  # noqa: E731
    (plain_s, refs, _), = interleaved([plain], prompts)
    plain_tps = sum(map(len, refs)) / plain_s
    w = torch.randn(a.block, a.block, dtype=torch.bfloat16)
    x = torch.randn(1, a.block, dtype=torch.bfloat16)
    block = lambda: x @ w  # noqa: E731
    block_ms = min(_ms(block) for _ in range(3))
    curve = cost_curve(ModelLevel(model), range(1, rows + 1), context=a.prompt_len, reps=5)  # prefill: a prompt's
    print(f"{a.shape}: plain {plain_tps:.2f} tokens/s; T(M) {', '.join(f'{t:.1f}' for t in curve.time_ms)} ms; "
          f"block {block_ms:.3f} ms", flush=True)
    results = []
    for rate in rates:
        planned = plan_oracle(curve, block_ms, [rate], widths, ks, a.new_tokens)
        picks = [next(t for t in planned if t[1] == 1), next((t for t in planned if t[1] > 1), None)]
        for pick in filter(None, picks):
            speedup, width, k, pred = pick
            refs_by = {tuple(pr): (i, pr + r) for i, (pr, r) in enumerate(zip(prompts, refs))}

            def chained(pr, width=width, k=k):
                seed, ref = refs_by[tuple(pr)]
                oracle = OracleLevel(ref, [rate], width, block, seed=seed,
                                     vocab_size=model.args.vocab_size, name=f"oracle/{width}")
                return Chain([ModelLevel(model, "target"), oracle], k=k).generate(pr, a.new_tokens)

            # the VM's speed, and the shape of T(M), drift within minutes: the prediction compared is made from T(1)
            # and T(k * width + 1) measured before each prompt's runs and after the last, averaged
            curves = []
            measure = lambda: curves.append(cost_curve(ModelLevel(model), [1, k * width + 1],  # noqa: E731
                                                       context=a.prompt_len, reps=5))
            (base_s, again, _), (chain_s, outs, stats) = interleaved([plain, chained], prompts, measure)
            measure()
            speedup, _, _, pred = plan_oracle(_mean_curve(curves), block_ms, [rate], [width], [k], a.new_tokens)[0]
            tau = sum(s.new_tokens for s in stats) / sum(s.target_forwards for s in stats)
            row = dict(shape=a.shape, rate=rate, width=width, k=k, predicted=speedup, predicted_tau=pred.tau,
                       measured=base_s / chain_s, tau=tau, efficiency=base_s / chain_s / speedup,
                       identical=sum(o == r == b for o, r, b in zip(outs, refs, again)), prompts=len(prompts))
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{a.shape}, plain decoding {plain_tps:.2f} tokens/s (compiled), {torch.get_num_threads()} threads\n")
    print("| rate | shape | k | tau predicted / measured | speedup predicted | measured | efficiency | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        kind = "path" if r["width"] == 1 else f"tree, width {r['width']}"
        print(f"| {r['rate']} | {kind} | {r['k']} | {r['predicted_tau']:.2f} / {r['tau']:.2f} | {r['predicted']:.2f}x "
              f"| {r['measured']:.2f}x | {r['efficiency']:.2f} | {r['identical']}/{r['prompts']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"plain_tokens_per_s": plain_tps, "t_m": curve.time_ms, "block_ms": block_ms,
                       "results": results}, f, indent=1)


def _mean_curve(curves: list[CostCurve]) -> CostCurve:
    """Measurements of one curve, averaged point by point."""
    a, mean = curves[0], lambda xs: sum(xs) / len(xs)  # noqa: E731
    return CostCurve(a.tokens, [mean(xs) for xs in zip(*(c.time_ms for c in curves))], a.context, a.prefill_tokens,
                     mean([c.prefill_ms for c in curves]), mean([c.decode_ms for c in curves]))


def _ms(fn, reps: int = 50) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


if __name__ == "__main__":
    main()
