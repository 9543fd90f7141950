"""PNG pictures of a profile: every level's cost curve T(M), every pair's accepted-length histogram.

Figures are `matplotlib.figure.Figure` objects drawn by the Agg canvas (no pyplot, no display, no
global backend switch) and written atomically (`artifacts.atomic_path`).
"""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from polybasic.artifacts import atomic_path
from polybasic.planner.profile import Profile


def save_png(fig: Figure, path: str | Path) -> Path:
    """Write `fig` to `path` as a PNG, atomically; no software/date stamp in its metadata."""
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    return path


def short(name: str, n: int = 40) -> str:
    """A label of at most n characters (long eagle:/path names keep their ends)."""
    return name if len(name) <= n else name[: n // 2 - 1] + "..." + name[-(n // 2 - 2):]


def plot_cost_curves(profile: Profile, path: str | Path) -> Path:
    """T_i(M) in ms vs M tokens per forward, one line per level, markers at the measured points;
    a log time axis when the levels span more than 20x (a target beside an n-gram lookup)."""
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.add_subplot()
    for lv in profile.levels:
        c = lv.cost  # tokens: M [n], time_ms: [n]
        ax.plot(c.tokens, c.time_ms, marker="o", ms=4, label=f"{short(lv.name)} ({lv.kind})")
    times = [t for lv in profile.levels for t in lv.cost.time_ms]
    log = min(times) > 0 and max(times) / min(times) > 20
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.1 0.2 0.5 1 2 5 10 ... ms
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    contexts = sorted({lv.cost.context for lv in profile.levels})
    ax.set(xlabel="M (tokens per forward)", ylabel="T(M) (ms, median" + (", log scale)" if log else ")"),
           title=f"Cost per forward, {profile.device}, context {'/'.join(map(str, contexts))} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="level (kind)")
    return save_png(fig, path)


def plot_acceptance(profile: Profile, path: str | Path) -> Path:
    """One panel per verifier<-drafter pair: the share of verifications per accepted length
    (accepted drafts + 1, 1..k+1) and a dashed line at the mean; a pair without a histogram shows
    only its mean."""
    pairs = profile.pairs
    cols = min(3, max(1, len(pairs)))
    rows = max(1, math.ceil(len(pairs) / cols))
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, p in zip(axes, pairs):
        total = sum(p.histogram.values())
        if total:
            xs = sorted(p.histogram)  # accepted lengths
            ax.bar(xs, [p.histogram[x] / total for x in xs], color="tab:blue", alpha=0.8,
                   label=f"n = {p.verifications}")
        else:
            ax.text(0.5, 0.5, "no histogram", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.axvline(p.mean_accepted_length, color="tab:red", ls="--", label=f"mean {p.mean_accepted_length:.2f}")
        ax.set_xticks(range(1, max([p.k + 1, *p.histogram]) + 1))
        ax.set_title(f"{short(p.verifier, 24)} <- {short(p.drafter, 24)} (k={p.k})", fontsize=9)
        ax.set(xlabel="accepted length", ylabel="share of verifications", ylim=(0, 1.05))
        ax.legend(fontsize=8, loc="upper right")
    for ax in axes[len(pairs):]:
        ax.set_axis_off()
    if not pairs:
        axes[0].text(0.5, 0.5, "no pairs profiled", ha="center", va="center", transform=axes[0].transAxes)
    fig.suptitle(f"Accepted length per verification ({profile.device})")
    return save_png(fig, path)
