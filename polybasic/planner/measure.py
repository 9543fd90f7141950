"""The profile stage's measurements: forward-cost curves of a level and acceptance of a pair.

Unlike the rest of polybasic.planner this module imports torch and the runtime; it turns levels into
the planner's pure data (CostCurve, LevelProfile, PairProfile, Profile). Times are medians of `reps`
calls after `warmup`, timed round-robin, through a timer that synchronizes a CUDA device.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence

import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError, check
from polybasic.planner.profile import CostCurve, LevelProfile, PairProfile, Profile
from polybasic.planner.theory import acceptance_rate
from polybasic.runtime.chain import Chain, check_k
from polybasic.runtime.context import timed
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.levels import Level, ModelLevel, NGramLevel
from polybasic.runtime.sampling import make_generator
from polybasic.runtime.stats import LinkStats, counts
from polybasic.runtime.with_lookup import drafting


def medians_ms(fns: Sequence[Callable[[], object]], device: torch.device | str = "cpu", reps: int = 10,
               warmup: int = 2) -> list[float]:
    """Median wall time in ms of each fn, timed round-robin (rep after rep of every fn), so that
    a load change on a shared machine hits all of them alike. A CUDA device is synchronized before
    and after each call."""
    check(reps >= 1 and warmup >= 0, "reps / warmup", f"need reps >= 1 and warmup >= 0, got {reps}, {warmup}",
          "e.g. reps=10, warmup=2")
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + reps):
        for fn, out in zip(fns, times):
            with timed(device) as t:
                fn()
            if i >= warmup:
                out.append(t.seconds * 1e3)
    return [statistics.median(t) for t in times]


def level_kind(level: Level) -> str:
    """The planner's kind of a runtime level: model | eagle | ngram (a WithLookup: its drafter's)."""
    level = drafting(level)
    if isinstance(level, ModelLevel):
        return "model"
    if isinstance(level, NGramLevel):
        return "ngram"
    if isinstance(level, EagleLevel):
        return "eagle"
    raise ConfigError(f"level '{level.name}': cannot profile a {type(level).__name__}; "
                      "use a ModelLevel, an EagleLevel or an NGramLevel")


def confidence_cut(level: Level, confidence: float) -> float:
    """The draft confidence that cuts `level`'s drafts as a chain's bottom: `confidence` for a model or a head (its
    path, alone or in a tree), 0 for an n-gram proposer (it cannot tell)."""
    return confidence if level_kind(level) != "ngram" else 0.0


def _device(level: Level) -> torch.device:
    level = drafting(level)
    if isinstance(level, ModelLevel):
        return torch.device(level.model.device)
    if isinstance(level, EagleLevel):
        return level.head.device
    return torch.device("cpu")


@torch.inference_mode()
def cost_curve(level, tokens: Iterable[int] = range(1, 7), context: int = 256, reps: int = 10,
               warmup: int = 2, seed: int = 0) -> CostCurve:
    """T(M) for M in `tokens` at a context of `context` tokens (random ids), plus the prefill of that
    context, and for a model the plain decode step vanilla generation runs. level: a chain Level or
    a bare model (lean decoder interface). What is timed is what the chain calls:
    ModelLevel.score (forward + distributions of the M rows); an EAGLE head's forward over M rows +
    the distribution of its last row; an n-gram lookup of M tokens."""
    if not isinstance(level, Level):
        level = ModelLevel(level, "model")
    level = drafting(level)  # a drafter with prompt lookup: the lookup's microseconds are not timed
    ms = sorted(set(tokens))
    check(bool(ms) and ms[0] >= 1, "tokens", f"must be token counts >= 1, got {ms}", "e.g. range(1, k + 2)")
    check(context >= 2, "context", f"must be >= 2, got {context}", "e.g. 256")
    kind, dev = level_kind(level), _device(level)
    limit = getattr(level, "max_seq_len", 1 << 30)
    if context + ms[-1] + 2 > limit:
        raise ConfigError(f"context: {context} + {ms[-1]} tokens exceed level '{level.name}''s window of {limit}; "
                          "lower context or the token counts")
    check(level.vocab_size is not None, f"level '{level.name}'.vocab_size", "is not set",
          "set it to the target's vocabulary size (a Chain does this for an n-gram level)")
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(2, max(level.vocab_size, 3), (context + ms[-1] + 1,), generator=g).tolist()
    prompt, extra = ctx[:context], ctx[context:]
    sampling = SamplingConfig()
    timed = lambda fns: medians_ms(fns, dev, reps, warmup)  # noqa: E731
    if kind == "ngram":
        times = timed([lambda m=m: level.propose(prompt, m, sampling, None, frozenset()) for m in ms])
        return CostCurve(ms, times, context, context, 0.0, None)
    level.start(context + ms[-1] + 2)
    if kind == "eagle":
        level.base.start(context + ms[-1] + 2)  # the head drafts on its base's features: a fresh base
        return _eagle_curve(level, prompt, extra, ms, timed)

    def prefill():
        level.cached = []
        level.score(prompt, [], sampling)

    def forward(m: int):  # M tokens fed at position `context`: one context token + m - 1 draft tokens
        level.cached = list(prompt)
        level.score(prompt + extra[:1], extra[1:m], sampling)

    def step():
        level.model(torch.tensor([extra[:1]], device=dev), context, last_only=True)

    prefill_ms, step_ms, *times = timed([prefill, step] + [lambda m=m: forward(m) for m in ms])
    return CostCurve(ms, times, context, context, prefill_ms, step_ms)


def _eagle_curve(level, prompt: list[int], extra: list[int], ms: list[int], timed) -> CostCurve:
    sampling = SamplingConfig()
    level.propose(prompt, 1, sampling, None, frozenset())  # the base prefills; features land in level.feats
    n, feats = len(prompt), level.feats

    def prefill():  # head rows 0..n-2 over the prompt's exact features
        level._feed(prompt[1:], feats[:n - 1], 0)

    def forward(m: int):  # m rows from position n - 1, then the distribution of the last one
        out = level._feed(extra[:m], feats[n - 1:n - 1 + m], n - 1)
        level._probs(out[-1], sampling)

    prefill_ms, *times = timed([prefill] + [lambda m=m: forward(m) for m in ms])
    return CostCurve(ms, times, n, n, prefill_ms, None)


def level_profile(level: Level, curve: CostCurve, base: str | None = None) -> LevelProfile:
    """LevelProfile of a runtime level; an EAGLE level's base defaults to its base level's name."""
    kind = level_kind(level)
    if kind == "eagle" and base is None:
        base = level.base.name
    return LevelProfile(level.name, kind, curve, base if kind == "eagle" else None)


def pair_acceptance(verifier: Level, drafter: Level, prompts: Sequence[list[int]], k: int,
                    sampling: SamplingConfig = SamplingConfig(), max_new_tokens: int = 64,
                    eos: Iterable[int] = (), seed: int = 0, draft_confidence: float = 0.0) -> PairProfile:
    """Acceptance of drafter's k-token drafts by verifier: a two-level Chain over held-out prompts
    (token ids; never the benchmark's). The per-token rate is Theorem 3.3 inverted on the
    verifications whose draft had all k tokens; the overhead is the chain's time outside the two
    levels' own calls, per verification. draft_fill (mean draft length / k) is 1 for a model or a
    head, which always propose k tokens but at a generation's end; for an n-gram proposer it is
    measured without each generation's last draft (cut by the budget). A drafter of token trees (tree_width > 1)
    also gets its tree sizes (sizes), and the planner takes its tokens per verification from the histogram; so does a
    drafter whose path drafts end early at draft_confidence (Chain.draft_confidence; sizes: its draft lengths, or its
    trees' sizes; forwards: the drafter's forwards per verification, which a cut tree's size does not tell)."""
    check_k(k)
    check(len(prompts) > 0, "prompts", "is empty", "pass held-out prompts from the training data")
    chain = Chain([verifier, drafter], k=k, eos=frozenset(eos), draft_confidence=draft_confidence)
    link = LinkStats(verifier.name, drafter.name)
    outside_s, inner, forwards = 0.0, [], 0  # inner: draft lengths but each generation's last
    dev = _device(verifier)
    for i, prompt in enumerate(prompts):
        g = make_generator(seed + i, dev) if not sampling.greedy else None
        _, st = chain.generate(list(prompt), max_new_tokens, sampling, g)
        skip = 1 if st.prompt_shared else 0  # the token the target committed from its prefill: no draft
        link.accepted += st.links[0].accepted[skip:]
        link.drafted += st.links[0].drafted[skip:]
        link.add_ranks(st.links[0].by_rank)
        inner += st.links[0].drafted[skip:-1]
        outside_s += st.wall_s - sum(lv["time_s"] for lv in st.levels)
        forwards += st.levels[1]["forwards"]
    s = link.summary()
    n = s["verifications"]
    check(n > 0, "prompts", "gave no verification", "pass longer generations (max_new_tokens >= 2)")
    full = [a + 1 for a, d in zip(link.accepted, link.drafted) if d == k]
    drafted = sum(link.drafted) / n
    if full:
        rate = acceptance_rate(sum(full) / len(full), k)
    else:  # no full-length draft (an n-gram proposer that rarely finds k tokens): the mean draft length
        rate = acceptance_rate(s["mean_accepted_length"], drafted) if drafted > 0 else 0.0
    fill = min(1.0, sum(inner) / len(inner) / k) if level_kind(drafter) == "ngram" and inner else 1.0
    sizes = counts(link.drafted) if drafter.tree_width > 1 or draft_confidence > 0 else {}
    return PairProfile(verifier.name, drafter.name, k, n, s["mean_accepted_length"], rate, fill, s["histogram"],
                       max(0.0, outside_s) * 1e3 / n, drafter.tree_width, sizes, s.get("by_rank", {}),
                       draft_confidence, forwards / n)


def profile_tokens(k: int) -> tuple[int, ...]:
    """The token counts M a level's T(M) is profiled at for drafts of k: every M up to 2(k+1), which holds a path of k
    (k+1 rows), a tree of it and one more candidate per depth or prompt lookup's continuation (up to 2k+1 rows, each
    measured, not interpolated: the step sizes they run at may jump between two sizes) and the chunk of k+1 a middle
    level hands up with the next draft; and 3(k+1) for longer chunks."""
    return tuple(sorted(set(range(1, 2 * (k + 1) + 1)) | {3 * (k + 1)}))


def build_profile(levels: Sequence[Level], pairs: Sequence[tuple[Level, Level]], prompts: Sequence[list[int]],
                  k: int, sampling: SamplingConfig = SamplingConfig(), context: int = 256, reps: int = 10,
                  max_new_tokens: int = 64, eos: Iterable[int] = (), device: str | None = None) -> Profile:
    """Every level's cost curve (M in profile_tokens(k)) and every (verifier, drafter) pair's acceptance, as one
    Profile. levels: the target first."""
    tokens = profile_tokens(k)
    for lv in levels[1:]:
        if lv.vocab_size is None:  # as Chain does: a model-free level takes the target's vocabulary
            lv.vocab_size = levels[0].vocab_size
    profiled = [level_profile(lv, cost_curve(lv, tokens, context, reps)) for lv in levels]
    accepted = [pair_acceptance(v, d, prompts, k, sampling, max_new_tokens, eos) for v, d in pairs]
    cfg = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    return Profile(levels[0].name, profiled, accepted, str(_device(levels[0]) if device is None else device), cfg)
