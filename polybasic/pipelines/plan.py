"""The `plan` stage: rank every chain the profile allows by predicted time per token (planner.search),
writing `<out>/plan.json` (rows, best first) and `<out>/plan.md` (one row per candidate: predicted
speedup under the measured-curve model and Lemma 3.1, Theorem 3.2's verdicts for inserted levels)."""
from __future__ import annotations

from pathlib import Path

from polybasic.artifacts import announce, write_text
from polybasic.pipelines.run import require
from polybasic.planner.plots import plot_acceptance, plot_cost_curves
from polybasic.planner.profile import Profile
from polybasic.planner.search import SearchSpace, plan, render_markdown


def check_inputs(recipe, out: Path, upstream: set[str]) -> None:
    """The profile exists unless this run makes it (the search space is checked with the recipe)."""
    require(out, "profile.json", "profile", upstream, "plan")


def run_stage(ctx) -> list[Path]:
    prof = Profile.load(ctx.out / "profile.json")
    sec = ctx.recipe.plan
    p = plan(prof, SearchSpace(list(sec.k_values), list(sec.thresholds), sec.max_levels, sec.new_tokens))
    p.save(ctx.out / "plan.json")
    pngs = [plot_cost_curves(prof, ctx.out / "cost_curves.png"), plot_acceptance(prof, ctx.out / "acceptance.png")]
    write_text(ctx.out / "plan.md", render_markdown(p) + "\n![cost curves](cost_curves.png)\n\n"
               "![acceptance](acceptance.png)\n")
    b = p.best
    announce(f"  best: {b.spec} (k={b.k}, thresholds {b.thresholds or '-'}): predicted {b.speedup:.2f}x "
             f"(Lemma 3.1: {b.speedup_lemma:.2f}x), tau {b.tau:.2f}; {len(p.rows)} candidates in {ctx.out / 'plan.md'}")
    return [ctx.out / "plan.json", ctx.out / "plan.md", *pngs]
