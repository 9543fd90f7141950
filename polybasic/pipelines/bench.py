"""The `bench` stage: the exported bundle's chain beside vanilla on Spec-Bench questions (the bench
command's own machinery, on the target the run already holds), writing `<out>/bench/report.md` and
`bench.json` with the plan's predicted speedup beside the measured one."""
from __future__ import annotations

import argparse
from pathlib import Path

from polybasic.bench import PEER_TIMEOUT_S
from polybasic.bench.questions import load_questions, select
from polybasic.bench.suite import open_run_log, run_bench, validate
from polybasic.pipelines.run import require
from polybasic.runtime.bundle import load


def _args(recipe, out: Path) -> argparse.Namespace:
    """The `polybasic bench --bundle` options this stage stands for."""
    b, p = recipe.bench, recipe.profile
    return argparse.Namespace(
        bundle=str(out / recipe.export.folder), model=None, dtype=recipe.model.dtype, device=recipe.model.device,
        questions=b.questions or None, per_category=b.per_category,
        categories=",".join(b.categories) or None, max_new_tokens=b.max_new_tokens, methods=b.methods,
        temperature=p.temperature, top_k=0, top_p=p.top_p, draft_tokens=p.k, adaptive_k=False, seed=0,
        warmup=b.warmup, repeat=b.repeat, threads=None, json_out=str(out / "bench" / "bench.json"),
        report=str(out / "bench"), no_progress=False, reprofile=False, thresholds=None, step_sizes=None,
        compile_mode="layers", draft_confidence=None, resume=True, strict=False, peer_timeout=PEER_TIMEOUT_S)


def check_inputs(recipe, out: Path, upstream: set[str]) -> None:
    require(out, f"{recipe.export.folder}/manifest.json", "export", upstream, "bench")
    b = recipe.bench
    select(load_questions(b.questions or None), b.per_category, b.categories or None)


def run_stage(ctx) -> list[Path]:
    a = _args(ctx.recipe, ctx.out)
    methods, sampling, questions = validate(a)
    # a killed stage continues its measurements; a changed recipe or bundle starts them over
    log = open_run_log(a, methods, questions, restart_changed=True)
    bundle = load(a.bundle, target=ctx.target, verify_target=False)
    run_bench(a, methods, sampling, questions, ctx.target, bundle, log)
    return [ctx.out / "bench" / "bench.json", ctx.out / "bench" / "report.md", ctx.out / "bench" / "speedup.png"]
