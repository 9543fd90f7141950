"""The recipe stages, in order, as a static table (importing it costs nothing: `polybasic --help`
and argument errors must not import torch or lightning).

A stage is a section of the recipe, the stages whose outputs it reads, and a runner
`"module:function"`, `run(ctx: pipelines.run.StageContext) -> list[Path]` (the files it wrote). The
runner loop (pipelines.run) fingerprints each stage's inputs (the model, its sections, its upstream
stages' fingerprints) and skips a stage whose record matches and whose outputs exist; a stage that
runs resumes from whatever it finished before an interruption.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    entry: str  # "module:function": run(ctx) -> list of output paths
    sections: tuple[str, ...]  # recipe sections its fingerprint covers (besides `model`)
    needs: tuple[str, ...] = ()  # upstream stages whose outputs it reads (when they are in the recipe)


STAGES: tuple[Stage, ...] = (
    Stage("quantize", "calibrate + quantize the target, evaluate and report",
          "polybasic.pipelines.quantize:run_stage", ("quantize",)),
    Stage("distill", "self-distill data and train EAGLE drafter heads (for the target and/or its copy)",
          "polybasic.pipelines.distill:run_stage", ("distill",), ("quantize",)),
    Stage("profile", "measure every candidate level's forward cost and every pair's acceptance",
          "polybasic.pipelines.profile:run_stage", ("profile", "export"), ("quantize", "distill")),  # export:
    # its draft_confidence cuts the drafts measured
    Stage("plan", "rank candidate chains by predicted time per token (the paper's theory + measured curves)",
          "polybasic.pipelines.plan:run_stage", ("plan",), ("profile",)),
    Stage("export", "write the planned chain as a bundle (manifest, level weights, model card)",
          "polybasic.pipelines.export:run_stage", ("export",), ("plan",)),
    Stage("bench", "run the bundle's chain beside vanilla on Spec-Bench: predicted vs measured speedup",
          "polybasic.pipelines.bench:run_stage", ("bench",), ("export",)),
)
NAMES = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    return next(s for s in STAGES if s.name == name)
