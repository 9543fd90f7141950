"""The `distill` stage: self-distill answers, compute each base's features, train EAGLE heads.

One head per entry of `drafters`: `target` (the recipe's model) and/or `quantized` (the copy the
quantize stage wrote, `<out_dir>/model.safetensors` unless `quantized` names another file). Both
learn from the same token sequences (the target's answers, plus the dataset's reference answers
when `references` is on); each learns from its own base's features.

Outputs in <out_dir>/distill (every step resumes: finished files are reused, never rewritten):
  samples.jsonl               token sequences, {"tokens": [...], "n_prompt": int} per line
  <drafter>/features/*.safetensors   cached features (features: cache)
  <drafter>/checkpoints/last.ckpt    Lightning checkpoint of the last finished epoch
  <drafter>/head.safetensors  the head's weights, DrafterConfig JSON in the metadata
  recipe.yaml                 the resolved recipe
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from polybasic.drafters.data import (DEFAULT_DATA, DistillDataset, Sample, compute_features, load_feature_shard,
                                     load_pairs, reference_samples, save_feature_shard, self_distill,
                                     self_instruct)
from polybasic.drafters.head import DrafterConfig
from polybasic.drafters.module import TrainConfig, fit
from polybasic.errors import ConfigError, check
from polybasic.pipelines.cli import STAGES
from polybasic.pipelines.serde import atomic_write_text, from_dict
from polybasic.runtime.sampling import SamplingConfig

DRAFTERS = ("target", "quantized")
SHARD = 256  # samples per feature shard


@dataclass
class DistillSection:
    data: str = DEFAULT_DATA  # Alpaca or ShareGPT JSON/JSONL; never the Spec-Bench questions
    limit: int = 1000  # first N records
    self_instruct: int = 0  # > 0: also this many prompts the target writes itself (Magpie), for diversity
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy answers
    max_prompt_tokens: int = 512
    seed: int = 0
    gen_batch_size: int = 32  # prompts per batched decode loop
    gen_dtype: str = "bfloat16"  # the target answers in this dtype (a bf16 copy is ~2x faster on CPU)
    references: bool = True  # also learn from the dataset's own answers (teacher-forced)
    features: str = "cache"  # cache: one batched prefill, safetensors shards; online: every step
    feature_dtype: str = "bfloat16"  # the float target's features are computed by a copy in this dtype
    feature_batch_tokens: int = 4096
    drafters: list[str] = field(default_factory=lambda: ["target"])
    quantized: str = ""  # the quantized copy; default <out_dir>/model.safetensors
    draft_vocab_size: int = 0  # > 0: EAGLE-3 style reduced draft vocabulary
    head_layers: int = 1  # decoder blocks in each head
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        from polybasic.models.loader import parse_dtype

        check(self.self_instruct >= 0, "distill.self_instruct", f"must be >= 0, got {self.self_instruct}",
              "use 0 (off) or the number of prompts the target should write")
        for name in ("limit", "max_new_tokens", "max_prompt_tokens", "gen_batch_size", "feature_batch_tokens",
                     "head_layers"):
            check(getattr(self, name) > 0, f"distill.{name}", f"must be > 0, got {getattr(self, name)}",
                  "use a positive int")
        check("spec_bench" not in self.data, "distill.data", "points at the Spec-Bench questions",
              "never train on the benchmark; use e.g. the Alpaca subset")
        check(self.features in ("cache", "online"), "distill.features", f"is {self.features!r}",
              "use 'cache' or 'online'")
        check(bool(self.drafters) and set(self.drafters) <= set(DRAFTERS), "distill.drafters",
              f"is {self.drafters}", f"list one or both of {', '.join(DRAFTERS)}")
        parse_dtype(self.gen_dtype)
        parse_dtype(self.feature_dtype)
        SamplingConfig(temperature=self.temperature)


def section_from_dict(data: dict) -> DistillSection:
    return from_dict(DistillSection, data, "distill")


def _as_dtype(model, dtype: str):
    """The model itself, or a copy in `dtype` (only float models; a quantized copy runs as saved)."""
    from polybasic.models.llama import use_decode_layout
    from polybasic.models.loader import parse_dtype
    from polybasic.quant.linear import QuantLinear

    dt = parse_dtype(dtype)
    if model.dtype == dt or any(isinstance(m, QuantLinear) for m in model.modules()):
        return model
    return use_decode_layout(copy.deepcopy(model).to(dt))


def _samples(lm, sec: DistillSection, out: Path, progress: bool = False) -> list[Sample]:
    path = out / "samples.jsonl"
    if path.is_file():
        return [Sample(**json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
    pairs = load_pairs(sec.data, sec.limit)
    gen = _as_dtype(lm.model, sec.gen_dtype)
    prompts = [q for q, _ in pairs]
    if sec.self_instruct:
        prompts += self_instruct(gen, lm.tokenizer, sec.self_instruct, seed=sec.seed,
                                 batch_size=sec.gen_batch_size, progress=progress)
    samples = self_distill(gen, lm.tokenizer, prompts, sec.max_new_tokens, SamplingConfig(temperature=sec.temperature),
                           sec.seed, sec.max_prompt_tokens, progress=progress, batch_size=sec.gen_batch_size)
    if sec.references:
        samples += reference_samples(lm.tokenizer, pairs, sec.max_prompt_tokens + sec.max_new_tokens)
    atomic_write_text(path, "".join(json.dumps({"tokens": s.tokens, "n_prompt": s.n_prompt}) + "\n"
                                    for s in samples))
    return samples


def _with_features(base, samples: list[Sample], sec: DistillSection, folder: Path,
                   progress: bool = False) -> list[Sample]:
    """Samples carrying the base's features, from cached shards (computed once, shard by shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = _as_dtype(base, sec.feature_dtype)
    out = []
    for k in range(0, len(samples), SHARD):
        path = folder / f"shard-{k // SHARD:05d}.safetensors"
        if not path.is_file():
            part = samples[k:k + SHARD]
            feats = compute_features(model, part, sec.feature_batch_tokens, progress,
                                     desc=f"features {folder.parent.name} {k // SHARD + 1}/{-(-len(samples) // SHARD)}")
            save_feature_shard(path, [Sample(s.tokens, s.n_prompt, f) for s, f in zip(part, feats)])
        out += load_feature_shard(path)
    return out


def _quantized_path(sec: DistillSection, run_dir: Path) -> Path:
    """The quantized copy the `quantized` drafter learns from; a clear error when it is missing."""
    path = Path(sec.quantized or run_dir / "model.safetensors")
    if not path.is_file():
        raise ConfigError(f"distill.quantized: {path} does not exist; run `polybasic quantize` on this recipe "
                          "first, or name the quantized copy's .safetensors file")
    return path


def _base_for(name: str, lm, sec: DistillSection, run_dir: Path):
    """The model a drafter drafts for: the target, or its quantized copy."""
    if name == "target":
        return lm.model
    from polybasic.models.loader import load_quantized_model

    return load_quantized_model(str(_quantized_path(sec, run_dir))).model


def run_distill(lm, sec: DistillSection, out: str | Path, progress: bool = False, run_dir: str | Path | None = None,
                **trainer_overrides) -> dict:
    """lm: a models.loader.LoadedModel (the target). Returns {drafter name: DistillModule}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    samples = _samples(lm, sec, out, progress)
    if not samples:
        raise ConfigError(f"distill.data: {sec.data} gave no training sequences; pass a file with prompts")
    head_cfg = DrafterConfig.for_base(lm.args, draft_vocab_size=sec.draft_vocab_size, n_layers=sec.head_layers)
    modules = {}
    for name in sec.drafters:
        base = _base_for(name, lm, sec, Path(run_dir or out.parent))
        data = samples if sec.features == "online" else _with_features(base, samples, sec, out / name / "features",
                                                                       progress)
        modules[name] = fit(base, DistillDataset(data, sec.train.max_len), head_cfg, sec.train, out / name,
                            **trainer_overrides)
    return modules


def check_inputs(recipe, out_dir: str | None = None) -> None:
    """Every input the stage will read exists and parses, before any model loads."""
    sec = recipe.distill
    load_pairs(sec.data, sec.limit)
    if "quantized" in sec.drafters:
        _quantized_path(sec, Path(out_dir or recipe.out_dir))


def run(recipe_path: str, out_dir: str | None = None) -> int:
    """`polybasic distill RECIPE.yaml`: distill drafter heads for the recipe's model (and its copy)."""
    from polybasic.models import load_model
    from polybasic.pipelines.recipe import load_recipe
    from polybasic.pipelines.serde import dump_recipe

    recipe = load_recipe(recipe_path)  # every field checked before the model loads
    check_inputs(recipe, out_dir)  # data errors before heavy work too
    run_dir = Path(out_dir or recipe.out_dir)
    out = run_dir / "distill"
    out.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, out / "recipe.yaml")
    lm = load_model(recipe.model.source, recipe.model.dtype)
    run_distill(lm, recipe.distill, out, progress=True, run_dir=run_dir, enable_progress_bar=True)
    for name in recipe.distill.drafters:
        print(f"wrote {out / name / 'head.safetensors'}")
    return 0


STAGES["distill"] = ("self-distill data and train EAGLE drafter heads (see recipes/)", run)
