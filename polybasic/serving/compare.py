"""serve-check's pure parts (no torch, no vllm): token-for-token identity, the first difference, vLLM's
acceptance length from its counters, the acceptance check, the JSON summary and the markdown report.

Definitions. vLLM's acceptance length is 1 + accepted draft tokens / drafts (its spec-decode
counters: every verification commits the accepted drafts and one token of the target's own). Our tau
is new tokens / target forwards (the prefill's forward included); our accept_len is vLLM's definition
on our chain (1 + mean accepted drafts per non-empty draft). A difference between two greedy outputs
is a near-tie when the target's two candidate tokens at the first differing position have logits within
`near_tie` of each other (fp32 kernels of two engines round otherwise; a near-tie flips either way).
"""
from __future__ import annotations

from collections.abc import Sequence

# the acceptance check: vLLM's acceptance length within 10% of our tau for the same head and k
ACCEPTANCE_TOLERANCE = 0.10
NEAR_TIE = 0.05  # logits: two fp32 implementations of one model differ by ~1e-4..1e-2 here
# the runs compared, by key: ours (our lean decoder), ours-eagle3 (our chain [target, head]), ours-compiled
# (our one-token step under torch.compile, optional), vllm, vllm-eagle3
OURS, OURS_CHAIN, OURS_COMPILED, VLLM, VLLM_SPEC = "ours", "ours-eagle3", "ours-compiled", "vllm", "vllm-eagle3"
PAIRS = ((VLLM_SPEC, VLLM), (VLLM, OURS), (VLLM_SPEC, OURS), (OURS_CHAIN, OURS), (OURS_COMPILED, OURS))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (one ending early counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float | None:
    """vLLM's mean acceptance length: tokens committed per verification (None without drafts)."""
    return 1 + num_accepted_tokens / num_drafts if num_drafts > 0 else None


def within(value: float | None, reference: float | None, tolerance: float = ACCEPTANCE_TOLERANCE) -> bool | None:
    """|value / reference - 1| <= tolerance (None where either is missing)."""
    if value is None or not reference:
        return None
    return abs(value / reference - 1) <= tolerance


def tokens_per_s(runs: Sequence[dict]) -> float | None:
    """Spec-Bench's aggregate: total new tokens / total wall time (runs: {'tokens', 'wall_s'})."""
    wall = sum(r["wall_s"] for r in runs)
    return sum(len(r["tokens"]) for r in runs) / wall if runs and wall > 0 else None


def differences(prompts: Sequence[dict], outputs: dict[str, list[list[int]]]) -> list[dict]:
    """Every prompt and pair of PAIRS (both present) whose outputs differ: {question_id, category,
    pair, position, tokens (the two tokens there; None past one's end), prompt_index}."""
    out = []
    for a, b in PAIRS:
        if a not in outputs or b not in outputs:
            continue
        for i, (p, x, y) in enumerate(zip(prompts, outputs[a], outputs[b])):
            pos = first_difference(x, y)
            if pos is not None:
                out.append({"prompt_index": i, "question_id": p["question_id"], "category": p["category"],
                            "pair": f"{a} vs {b}", "position": pos,
                            "tokens": [x[pos] if pos < len(x) else None, y[pos] if pos < len(y) else None]})
    return out


def identical_counts(outputs: dict[str, list[list[int]]]) -> dict[str, int]:
    """{'A vs B': prompts with identical outputs} for every pair of PAIRS that ran."""
    return {f"{a} vs {b}": sum(x == y for x, y in zip(outputs[a], outputs[b]))
            for a, b in PAIRS if a in outputs and b in outputs}


def summary(prompts: Sequence[dict], runs: dict[str, list[dict]], *, k: int, vllm_spec: dict | None,
            our_tau: float | None, our_accept_len: float | None, our_spec: dict | None = None,
            gaps: Sequence[dict] = (),
            near_tie: float = NEAR_TIE, config: dict | None = None, machine: dict | None = None,
            vllm_info: dict | None = None) -> dict:
    """The JSON summary. prompts: [{question_id, category, prompt_tokens}]; runs: {run key: per-prompt
    [{tokens, wall_s}]}; vllm_spec: vLLM's counters summed over the timed prompts; our_spec: our chain's,
    counted alike ({num_drafts, num_accepted_tokens}); gaps: differences()
    rows with the target's logit gap added ({..., 'gap', 'top2_gap', 'top2'}). Keys: prompts,
    identical, vllm_acceptance, our_tau, tokens_per_s, checks and the rest."""
    outputs = {key: [r["tokens"] for r in rs] for key, rs in runs.items()}
    n = len(prompts)
    identical = identical_counts(outputs)
    acc = acceptance_length(vllm_spec["num_drafts"], vllm_spec["num_accepted_tokens"]) if vllm_spec else None
    diffs = list(gaps) if gaps else differences(prompts, outputs)
    spec_pair = f"{VLLM_SPEC} vs {VLLM}"
    spec_diffs = [d for d in diffs if d["pair"] == spec_pair]
    all_near_ties = all(d.get("gap") is not None and d["gap"] <= near_tie for d in spec_diffs)
    tps = {key: tokens_per_s(rs) for key, rs in runs.items()}
    return {
        "prompts": n,
        "identical": identical,
        "vllm_acceptance": acc,
        "our_tau": our_tau,
        "our_accept_len": our_accept_len,
        "k": k,
        "tokens_per_s": tps,
        "speedup": {key: (v / tps[base] if v and tps.get(base) else None)
                    for key, v in tps.items()
                    for base in ([OURS] if key.startswith("ours") else [VLLM])},
        "vllm_spec_counters": vllm_spec,
        "our_spec_counters": our_spec,
        "differences": diffs,
        "checks": {
            # the check: identical to vLLM's vanilla on at least n-1 prompts, every difference a near-tie
            "vllm_eagle3_identical_to_vllm": (identical.get(spec_pair, 0) >= n - 1 and all_near_ties)
            if spec_pair in identical else None,
            "acceptance_within_10pct_of_our_tau": within(acc, our_tau),
            "acceptance_within_10pct_of_our_accept_len": within(acc, our_accept_len),
        },
        "near_tie": near_tie,
        "config": config or {},
        "machine": machine or {},
        "vllm": vllm_info or {},
        "per_prompt": [{**p, **{f"{key}_tokens": len(rs[i]["tokens"]) for key, rs in runs.items()},
                        **{f"{key}_wall_s": rs[i]["wall_s"] for key, rs in runs.items()},
                        **({"vllm_accept_len": acceptance_length(runs[VLLM_SPEC][i]["spec"]["num_drafts"],
                                                                 runs[VLLM_SPEC][i]["spec"]["num_accepted_tokens"])}
                           if VLLM_SPEC in runs and "spec" in runs[VLLM_SPEC][i] else {})}
                       for i, p in enumerate(prompts)],
    }


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(doc: dict) -> str:
    """A short report of a summary: the speed table, identity, acceptance, the differences."""
    n, tps, sp = doc["prompts"], doc["tokens_per_s"], doc["speedup"]
    m, c = doc.get("machine") or {}, doc.get("config") or {}
    lines = ["# serve-check: vLLM beside polybasic's runtime", "",
             f"{n} Spec-Bench prompts, {c.get('max_new_tokens', '?')} new tokens each, greedy, one request at a "
             f"time, k = {doc['k']}; {m.get('cpu', '?')}, {c.get('threads', '?')} threads; vLLM "
             f"{(doc.get('vllm') or {}).get('version', '?')}, target {c.get('target', '?')} in "
             f"{c.get('dtype', '?')}.", "",
             "| run | tokens/s | speedup over its vanilla |", "|---|---|---|"]
    names = {OURS: "polybasic vanilla", OURS_CHAIN: "polybasic chain [target, EAGLE-3 head]",
             OURS_COMPILED: "polybasic vanilla-compiled",
             VLLM: "vLLM vanilla", VLLM_SPEC: "vLLM eagle3 (the exported head)"}
    for key, v in tps.items():
        lines.append(f"| {names.get(key, key)} | {_f(v)} | {_f(sp.get(key))} |")
    lines += ["", "| identity | prompts |", "|---|---|"]
    lines += [f"| {pair} | {same}/{n} |" for pair, same in doc["identical"].items()]
    lines += ["", f"vLLM's acceptance length {_f(doc['vllm_acceptance'], '.3f')}; our tau "
                  f"{_f(doc['our_tau'], '.3f')}, our acceptance length {_f(doc['our_accept_len'], '.3f')} "
                  f"(same head, same k)."]
    if doc["differences"]:
        lines += ["", f"First differences (logits of our target there; a near-tie: gap <= {doc['near_tie']}):", "",
                  "| prompt | pair | position | tokens | their logit gap | top-2 gap |", "|---|---|---|---|---|---|"]
        for d in doc["differences"]:
            lines.append(f"| {d['question_id']} ({d['category']}) | {d['pair']} | {d['position']} | "
                         f"{d['tokens'][0]} / {d['tokens'][1]} | {_f(d.get('gap'), '.4f')} | "
                         f"{_f(d.get('top2_gap'), '.4f')} |")
    lines += ["", "Checks: " + ", ".join(f"{k} {'-' if v is None else ('yes' if v else 'NO')}"
                                        for k, v in doc["checks"].items()) + "."]
    if c.get("command"):
        lines += ["", f"Command: `{c['command']}`"]
    return "\n".join(lines) + "\n"
