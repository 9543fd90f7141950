"""Predicted speedups of a bench's chain methods (`polybasic bench --predict N`).

Each chain method's levels are profiled as the profile stage profiles a bundle's: every level's forward cost T(M)
and every link's acceptance over N held-out prompts (the last records of the shipped Alpaca set, never a
benchmark's), on the method's own levels (compiled for a *-compiled method). The planner's cost model
(planner.cost.predict) then prices the chain at the method's k and thresholds over the run's token budget. The
prediction is against plain decoding on the same target steps, so for a *-compiled method it compares with the
measured speedup over vanilla-compiled. Levels and links shared by several methods are measured once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from polybasic.config import SamplingConfig
from polybasic.data.catalog import ALPACA
from polybasic.drafters.data import load_pairs
from polybasic.planner.cost import ChainConfig, predict
from polybasic.planner.measure import confidence_cut, cost_curve, level_profile, pair_acceptance, profile_tokens
from polybasic.planner.profile import Profile
from polybasic.runtime.text import encode_prompt

PROFILE_TOKENS = 64  # new tokens per held-out prompt when a link's acceptance is measured
CONTEXT = 256  # the context T(M) is measured at, as the profile stage's default


def held_out_prompts(tokenizer, n: int) -> list[list[int]]:
    """The last n records of the shipped Alpaca set as prompt ids (the chat template applied)."""
    return [encode_prompt(tokenizer, q) for q, _ in load_pairs(ALPACA)[-n:]]


def predict_chains(chains: dict[str, tuple[Callable[[], list], int, list[int] | None, float]],
                   prompts: Sequence[list[int]],
                   eos, sampling: SamplingConfig, max_new_tokens: int,
                   notify: Callable[[str], None] = lambda _: None) -> dict[str, float]:
    """{method: (its levels' maker, k, thresholds or None, draft confidence)} -> {method: the predicted speedup over
    plain decoding}. A chain whose drafts a confidence cuts has its bottom pair measured so (planner.cost prices the
    measured lengths)."""
    curves, links, out = {}, {}, {}
    for method, (make_levels, k, thresholds, confidence) in chains.items():
        levels = make_levels()
        for lv in levels[1:]:  # as Chain does: a model-free level takes the target's vocabulary
            lv.vocab_size = lv.vocab_size or levels[0].vocab_size
        names = [lv.name for lv in levels]
        if len(set(names)) < len(names):
            notify(f"[{method}: no prediction, two levels share a name]")
            continue
        notify(f"[{method}: profiling its levels for the predicted speedup]")
        window = min(getattr(lv, "max_seq_len", 1 << 30) for lv in levels)
        tokens = profile_tokens(k)
        context = max(2, min(CONTEXT, window - tokens[-1] - 2))
        fit = [p[-(window - PROFILE_TOKENS - k * levels[-1].tree_width - 4):] for p in prompts]
        for lv in levels:
            if (id(lv), tokens) not in curves:
                curves[id(lv), tokens] = level_profile(lv, cost_curve(lv, tokens, context, reps=5))
        cut = confidence_cut(levels[-1], confidence)  # the bottom's drafts only
        keys = [(id(v), id(d), k, cut if d is levels[-1] else 0.0) for v, d in zip(levels, levels[1:])]
        for (v, d), key in zip(zip(levels, levels[1:]), keys):
            if key not in links:
                links[key] = pair_acceptance(v, d, fit, k, sampling, PROFILE_TOKENS, eos, draft_confidence=key[3])
        profile = Profile(names[0], [curves[id(lv), tokens] for lv in levels], [links[key] for key in keys])
        cfg = ChainConfig(tuple(names), k, tuple(thresholds or [k + 1] * (len(levels) - 2)))
        out[method] = predict(profile, cfg, new_tokens=max_new_tokens).speedup
    return out
