"""Run every method on the same prompts (interleaved, rotated order) and aggregate Spec-Bench style.

With repeat N each method runs N times on every prompt, the rounds interleaved (each rotated once more), and a
record keeps the fastest run's wall time (best of N, as timeit): on a shared machine a slow spell of a few
seconds hits whichever method runs then, not a method. Every run's time is kept in the record (`walls`).

Aggregates follow Spec-Bench: tokens/s = total new tokens / total wall time over the prompts of a
group; speedup = a method's tokens/s / vanilla's tokens/s on the same prompts; tau = total new
tokens / total target forwards (chain methods only). median_speedup, the median over prompts of
the per-prompt speedup, is added because a shared machine's noise can swamp the totals.
speedup_vs_fastest_vanilla divides by the fastest of the run's vanilla decoders (vanilla,
vanilla:DTYPE, vanilla-compiled...) instead of the reference.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from polybasic.bench.methods import Output, Runner
from polybasic.bench.peers import Failure, MethodFailed

REFERENCE = "vanilla"
COMPILED_REFERENCE = "vanilla-compiled"  # compiled chains' own reference: a compiled target rounds as eager does not
VANILLA_PREFIXES = ("vanilla:", "vanilla-compiled")  # with REFERENCE: the plain decoders


@dataclass
class Record:
    method: str
    question_id: int | str
    category: str
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    tau: float | None
    tokens: list[int]
    accepted: list[int] | None = None  # bottom link: accepted drafts per verification (chains)
    links: dict[str, list[int]] | None = None  # every link's, by name 'verifier<-drafter' (chains)
    walls: list[float] | None = None  # with repeat > 1: every run's wall time, in the order run (wall_s: the least)


def run_all(runners: dict[str, Runner], prompts: Sequence[tuple[object, str, list[int]]],
            seed: int = 0, warmup: int = 1, progress: bool = True, *, order: Sequence[str] | None = None,
            done: Collection[tuple] = (), on_record: Callable[[Record], None] | None = None,
            on_failure: Callable[[Failure], None] | None = None, repeat: int = 1) -> list[Record]:
    """prompts: (question_id, category, prompt_ids). Method order rotates by one per prompt (and per round of a
    prompt's `repeat` rounds; a record then keeps the fastest round's time, see the module's docstring).

    Warm-up runs each method untimed on the first `warmup` prompts (cycled if fewer prompts).
    order: the rotation's methods (default: the runners'); one without a runner (finished or failed in a
    resumed run) keeps its place and is skipped. done: (method, question_id, category) pairs measured
    already (a resumed run), skipped. on_record: told each record as it is measured. on_failure: told a
    method's MethodFailed (with the prompt it was on), after which the method is skipped; without it the
    error propagates. Returns the records measured here, in the order measured.
    """
    from tqdm.auto import tqdm

    names, live, done = list(order or runners), dict(runners), set(done)
    todo = sum((m, q, c) not in done for m in live for q, c, _ in prompts)
    bar = tqdm(total=warmup * len(live) + todo * repeat, desc="bench", unit="run", disable=not progress,
               dynamic_ncols=True)
    call = _caller(live, on_failure)
    try:
        for w in range(warmup):
            qid, cat, ids = prompts[w % len(prompts)]
            for name in [n for n in names if n in live]:
                bar.set_postfix_str(f"warm-up {name}")
                call(name, ids, seed, "warm-up", qid, cat)
                bar.update()
        records: list[Record] = []
        for i, (qid, cat, ids) in enumerate(prompts):
            outs: dict[str, list[Output]] = {}
            for rnd in range(repeat):
                r = (i + rnd) % len(names)
                for name in names[r:] + names[:r]:
                    if name not in live or (name, qid, cat) in done:
                        continue
                    bar.set_postfix_str(f"{cat} {name}" + (f" ({rnd + 1}/{repeat})" if repeat > 1 else ""))
                    out = call(name, ids, seed + i, "prompt", qid, cat)
                    bar.update()
                    if out is not None:
                        outs.setdefault(name, []).append(out)
            for name, runs in outs.items():
                if name not in live:  # failed in a later round: no record
                    continue
                records.append(_record(name, qid, cat, ids, runs))
                if on_record:
                    on_record(records[-1])
    finally:
        bar.close()
    return records


def _record(name: str, qid, cat: str, ids: list[int], runs: list[Output]) -> Record:
    """One method's record of a prompt from its runs (the same seed each): the first run's tokens and statistics,
    the fastest run's wall time. Runs that made other tokens are a determinism bug, reported, not averaged away."""
    first = runs[0]
    if any(o.tokens != first.tokens for o in runs[1:]):
        raise RuntimeError(f"method {name}: its runs on question {qid} ({cat}) made different tokens with the same "
                           "seed; a method must be deterministic for --repeat")
    walls = [o.wall_s for o in runs]
    return Record(name, qid, cat, len(ids), len(first.tokens), min(walls), first.tau, list(first.tokens),
                  first.accepted, first.links, walls if len(runs) > 1 else None)


def _caller(live: dict[str, Runner], on_failure: Callable[[Failure], None] | None):
    """(name, ids, seed, stage, question_id, category) -> the runner's Output, or None when it failed: the
    method then leaves `live` and on_failure is told where it was."""
    def call(name: str, ids: list[int], seed: int, stage: str, qid, cat: str) -> Output | None:
        try:
            return live[name](ids, seed)
        except MethodFailed as e:
            if on_failure is None:
                raise
            del live[name]
            on_failure(replace(e.failure, method=name, stage=stage, question_id=qid, category=cat))
            return None
    return call


def _same(records: list[Record], reference: dict) -> int:
    return sum(r.tokens == reference[(r.question_id, r.category)].tokens for r in records)


def _group(records: list[Record], reference: dict, greedy: bool, compiled: dict | None = None) -> dict:
    tokens = sum(r.new_tokens for r in records)
    wall = sum(r.wall_s for r in records)
    tps = tokens / wall if wall > 0 else 0.0
    taus = [r for r in records if r.tau]
    # target forwards per prompt = new tokens / tau; tau overall = tokens / forwards
    tau = (sum(r.new_tokens for r in taus) / sum(r.new_tokens / r.tau for r in taus)
           if taus and len(taus) == len(records) else None)
    acc = [a for r in records for a in (r.accepted or [])]
    out = {"tokens_per_s": tps, "tau": tau,
           # the bottom drafter's mean accepted length: accepted drafts + 1 per verification
           "accept_len": 1 + sum(acc) / len(acc) if acc else None,
           "identical_to_vanilla": f"{_same(records, reference)}/{len(records)}" if greedy else None,
           "new_tokens": tokens, "wall_s": wall, "prompts": len(records)}
    if greedy and compiled:  # the run has vanilla-compiled: the tokens a compiled chain must equal
        out["identical_to_vanilla_compiled"] = f"{_same(records, compiled)}/{len(records)}"
    return out


def summarize(records: list[Record], greedy: bool, predicted: dict[str, float | None] | None = None
              ) -> dict[str, dict]:
    """{method: {tokens_per_s, speedup, speedup_vs_fastest_vanilla, tau, accept_len, links,
    identical_to_vanilla, [identical_to_vanilla_compiled,] predicted_speedup, per_category}}."""
    ref = {(r.question_id, r.category): r for r in records if r.method == REFERENCE}
    cref = {(r.question_id, r.category): r for r in records if r.method == COMPILED_REFERENCE} or None
    methods = list(dict.fromkeys(r.method for r in records))
    cats = list(dict.fromkeys(r.category for r in records))
    out: dict[str, dict] = {}
    base = _group([r for r in records if r.method == REFERENCE], ref, greedy)
    base_cat = {c: _group([r for r in records if r.method == REFERENCE and r.category == c], ref, greedy)
                for c in cats}
    for m in methods:
        mine = [r for r in records if r.method == m]
        g = _group(mine, ref, greedy, cref)
        g["speedup"] = _ratio(g["tokens_per_s"], base["tokens_per_s"])
        g["median_speedup"] = _median_speedup(mine, ref)
        g["predicted_speedup"] = (predicted or {}).get(m)
        g["links"] = _link_lengths(mine)
        g["per_category"] = {}
        for c in cats:
            gc = _group([r for r in mine if r.category == c], ref, greedy)
            gc["speedup"] = _ratio(gc["tokens_per_s"], base_cat[c]["tokens_per_s"])
            g["per_category"][c] = gc
        out[m] = g
    best = fastest_vanilla(out)
    fastest = out[best]["tokens_per_s"] if best else 0.0
    for g in out.values():
        g["speedup_vs_fastest_vanilla"] = _ratio(g["tokens_per_s"], fastest)
    return out


def is_vanilla(method: str) -> bool:
    return method == REFERENCE or method.startswith(VANILLA_PREFIXES)


def fastest_vanilla(summary: dict[str, dict]) -> str | None:
    """The vanilla decoder of a summary with the most tokens/s (None if it has none)."""
    return max((m for m in summary if is_vanilla(m)), key=lambda m: summary[m]["tokens_per_s"], default=None)


def _link_lengths(records: list[Record]) -> dict[str, float | None] | None:
    """{link: mean accepted length (accepted drafts + 1) pooled over verifications}; None if no chain."""
    pooled: dict[str, list[int]] = {}
    for r in records:
        for name, acc in (r.links or {}).items():
            pooled.setdefault(name, []).extend(acc)
    return {n: 1 + sum(a) / len(a) if a else None for n, a in pooled.items()} or None


def _median_speedup(records: list[Record], ref: dict) -> float | None:
    ratios = []
    for r in records:
        v = ref[(r.question_id, r.category)]
        if r.wall_s > 0 and v.wall_s > 0 and v.new_tokens > 0:
            ratios.append((r.new_tokens / r.wall_s) / (v.new_tokens / v.wall_s))
    return statistics.median(ratios) if ratios else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None
