"""The `distill` stage: self-distill answers from the base model, then train the EAGLE head.

Outputs in the out folder (a rerun resumes):
  samples.jsonl       the base model's answers, {"tokens": [...], "n_prompt": int} per line
  checkpoints/last.ckpt  Lightning checkpoint of the last finished epoch (the resume point)
  head.safetensors    the head's weights, DrafterConfig JSON in the metadata
  recipe.yaml         the resolved recipe
Run with `polybasic distill RECIPE.yaml [--out DIR]` (the recipe's `distill` section).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from polybasic.drafters.data import DEFAULT_DATA, DistillDataset, Sample, load_prompts, self_distill
from polybasic.drafters.head import DrafterConfig
from polybasic.drafters.module import TrainConfig, fit
from polybasic.errors import check
from polybasic.pipelines.cli import STAGES
from polybasic.pipelines.serde import atomic_write_text, from_dict
from polybasic.runtime.sampling import SamplingConfig


@dataclass
class DistillSection:
    data: str = DEFAULT_DATA  # Alpaca or ShareGPT JSON/JSONL; never the Spec-Bench questions
    limit: int = 1000  # first N records
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy answers
    max_prompt_tokens: int = 512
    seed: int = 0
    draft_vocab_size: int = 0  # > 0: EAGLE-3 style reduced draft vocabulary
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        for name in ("limit", "max_new_tokens", "max_prompt_tokens"):
            check(getattr(self, name) > 0, f"distill.{name}", f"must be > 0, got {getattr(self, name)}",
                  "use a positive int")
        check("spec_bench" not in self.data, "distill.data", "points at the Spec-Bench questions",
              "never train on the benchmark; use e.g. the Alpaca subset")
        SamplingConfig(temperature=self.temperature)


def section_from_dict(data: dict) -> DistillSection:
    return from_dict(DistillSection, data, "distill")


def _samples(lm, sec: DistillSection, out: Path, progress: bool = False) -> list[Sample]:
    path = out / "samples.jsonl"
    if path.is_file():
        return [Sample(**json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
    prompts = load_prompts(sec.data, sec.limit)
    samples = self_distill(lm.model, lm.tokenizer, prompts, sec.max_new_tokens,
                           SamplingConfig(temperature=sec.temperature), sec.seed, sec.max_prompt_tokens,
                           progress=progress)
    atomic_write_text(path, "".join(json.dumps(s.__dict__) + "\n" for s in samples))
    return samples


def run_distill(lm, sec: DistillSection, out: str | Path, progress: bool = False, **trainer_overrides):
    """lm: a models.loader.LoadedModel (the base the head drafts for). Returns the DistillModule."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    samples = _samples(lm, sec, out, progress)
    head_cfg = DrafterConfig.for_base(lm.args, draft_vocab_size=sec.draft_vocab_size)
    return fit(lm.model, DistillDataset(samples, sec.train.max_len), head_cfg, sec.train, out,
               **trainer_overrides)


def run(recipe_path: str, out_dir: str | None = None) -> int:
    """`polybasic distill RECIPE.yaml`: distill a drafter head for the recipe's model."""
    from polybasic.models import load_model
    from polybasic.pipelines.recipe import load_recipe
    from polybasic.pipelines.serde import dump_recipe

    recipe = load_recipe(recipe_path)  # every field checked before the model loads
    load_prompts(recipe.distill.data, recipe.distill.limit)  # data errors before heavy work too
    out = Path(out_dir or recipe.out_dir) / "distill"
    out.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, out / "recipe.yaml")
    lm = load_model(recipe.model.source, recipe.model.dtype)
    run_distill(lm, recipe.distill, out, progress=True, enable_progress_bar=True)
    print(f"wrote {out / 'head.safetensors'}")
    return 0


STAGES["distill"] = ("self-distill data and train an EAGLE drafter head (see recipes/)", run)
