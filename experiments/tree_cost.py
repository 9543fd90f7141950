"""T(M) of a target's compiled verification as paths and as token trees of the same rows: what a drafter with prompt
lookup (a tree of its draft and the lookup's branch) costs the level that verifies it.

python -m experiments.tree_cost --model qwen2.5-coder-1.5b@w4a8 --sizes 1,2,4,6,8,64 --context 300 --reps 12

Each call scores M rows after a fixed context (the cache then rolled back), path and tree alternated, the median of
--reps after 2 warm ones.
Trees: a path of ceil(M/2) rows from the context and a branch of the rest off its first node. Paths and trees run
the same compiled step of each size (Transformer.paths_as_trees).

--spells SECONDS: then, for that long, rounds of one call of every M in turn (trees from 3 rows), sorted by their
T(1) into quarters: each quarter's median T(1) and T(M)/T(1). On a VM whose memory speed moves, this says what
bounds T(M) at each speed: where T(1) is slow (the weights' bytes) extra rows are nearly free; where it is fast, the
rows' products show.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from polybasic.config import SamplingConfig
from polybasic.models.static import covering
from polybasic.quant.api import load_any_model
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.levels import ModelLevel


def tree_of(m: int) -> list[int]:
    """Parents of an m-node tree: a path of ceil(m/2) nodes and a branch of the rest below its first node."""
    a = (m + 1) // 2
    return list(range(-1, a - 1)) + [0 if j == 0 else a + j - 1 for j in range(m - a)]


def quarters(rounds: Sequence[Sequence[float]]) -> list[tuple[float, list[float]]]:
    """Rounds of times [T(1), T(M2), ...] (ms) -> per quarter of the rounds sorted by T(1), fastest first: (median
    T(1), [median T(M)/T(1) for each later M]). Fewer than 4 rounds: one group of all."""
    rs = sorted(rounds, key=lambda r: r[0])
    n = len(rs) // 4
    parts = [rs[i * n:(i + 1) * n if i < 3 else len(rs)] for i in range(4)] if n else [rs]
    return [(statistics.median(r[0] for r in part),
             [statistics.median(r[i] / r[0] for r in part) for i in range(1, len(part[0]))]) for part in parts]


def main(argv: list[str] | None = None) -> dict[int, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="1,2,4,6,8,64", help="compiled step sizes")
    ap.add_argument("--rows", default="1,4,5,7", help="rows M per call (a draft of M-1 tokens)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--spells", type=float, default=0, help="then this many seconds of rounds of every M, "
                    "by quarter of T(1) (see above)")
    a = ap.parse_args(argv)
    lm = load_any_model(a.model, a.dtype, "cpu")
    target = ModelLevel(lm.model, "target")
    rows = [int(r) for r in a.rows.split(",")]
    compile_levels([target], a.context + max(rows) + 2, lm.gguf_file,
                   covering(tuple(int(s) for s in a.sizes.split(",")), [max(rows)], lm.model.device), rows=[max(rows)])
    vocab = lm.args.vocab_size
    ctx = [(7919 * i) % (vocab - 2) + 2 for i in range(a.context)]
    sampling = SamplingConfig()
    target.start(a.context + max(rows) + 2)
    target.score(ctx, [], sampling)

    def once(draft: list[int], parents: list[int] | None) -> float:
        t0 = time.perf_counter()
        target.score(ctx, draft, sampling, parents=parents)
        if parents is not None:
            target.keep_path(ctx, draft, parents, [])
        else:
            target.cached = list(ctx)
        return (time.perf_counter() - t0) * 1e3

    drafts = {m: [(31 * j) % (vocab - 2) + 2 for j in range(m - 1)] for m in {1, *rows}}  # M-1 draft tokens
    out = {}
    print(f"{a.model}, context {a.context}, compiled sizes {a.sizes}, median of {a.reps} (path and tree alternated)")
    print("| rows M | path | tree |\n|---|---|---|")
    for m in rows:
        shapes = [None] + ([tree_of(m - 1)] if m > 2 else [])
        times = [[once(drafts[m], parents) for parents in shapes] for _ in range(a.reps + 2)][2:]
        medians = [statistics.median(t[i] for t in times) for i in range(len(shapes))]
        out[m] = {"path_ms": medians[0], "tree_ms": medians[1] if len(medians) > 1 else None}
        tree = f"{out[m]['tree_ms']:.1f} ms" if out[m]["tree_ms"] is not None else "-"
        print(f"| {m} | {out[m]['path_ms']:.1f} ms | {tree} |")
    if a.spells > 0:
        ms = [1] + [m for m in rows if m != 1]  # T(1) first: the rounds are sorted by it
        rounds, end = [], time.perf_counter() + a.spells
        while time.perf_counter() < end or not rounds:
            rounds.append([once(drafts[m], tree_of(m - 1) if m > 2 else None) for m in ms])
        later = ms[1:]
        print(f"\n{len(rounds)} rounds of every M in {a.spells:.0f} s, by quarter of T(1) (trees from 3 rows):")
        print("| quarter | T(1) | " + " | ".join(f"T({m})/T(1)" for m in later) + " |\n|---|---|" + "---|" * len(later))
        out["spells"] = quarters(rounds)
        for i, (t1, ratios) in enumerate(out["spells"]):
            print(f"| {i + 1} | {t1:.1f} ms | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")
    return out


if __name__ == "__main__":
    main()
