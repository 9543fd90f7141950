"""The `distill` stage: self-distill answers, compute each base's features, train EAGLE heads.

One head per entry of `drafters`: `target` (the recipe's model) and/or `quantized` (the copy the
quantize stage wrote, `<out_dir>/model.safetensors` unless `quantized` names another file). Both
learn from the same token sequences (the target's answers, plus the dataset's reference answers
when `references` is on); each learns from its own base's features.

Outputs in <out_dir>/distill, all written atomically (every step resumes: finished files are
reused, never rewritten, but a feature shard made from other samples is made again; a rerun removes the temp
files of a killed run and prints what it reused):
  samples.jsonl               token sequences, {"tokens": [...], "n_prompt": int} per line
  samples/                    the generation's shards, one per batch (prompts-*, answers-*.jsonl),
                              and inputs.json, the settings they were made with; more-I/ the same for
                              the prompts of more_data[I]
  <drafter>/features/*.safetensors   cached features (features: cache)
  <drafter>/checkpoints/last.ckpt    Lightning checkpoint: every epoch and every
                              train.checkpoint_every_n_steps steps
  <drafter>/head.safetensors  the head's weights, DrafterConfig JSON in the metadata
  recipe.yaml                 the resolved recipe
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from polybasic.artifacts import announce, clean_and_announce, seed_for, write_json, write_text
from polybasic.config import DistillSection, SamplingConfig, dump_recipe
from polybasic.drafters.data import (
    DistillDataset,
    Sample,
    compute_features,
    load_feature_shard,
    load_pairs,
    reference_samples,
    save_feature_shard,
    self_distill,
    self_instruct,
)
from polybasic.drafters.module import fit
from polybasic.errors import ConfigError
from polybasic.models.decoder import use_decode_layout
from polybasic.models.eagle_head import DrafterConfig
from polybasic.models.loader import parse_dtype
from polybasic.quant.api import load_quantized_model
from polybasic.quant.linear import QuantLinear
from polybasic.runtime.context import ExecutionContext

SHARD = 256  # samples per feature shard


def _as_dtype(model, dtype: str):
    """The model itself, or a copy in `dtype` (only float models; a quantized copy runs as saved)."""
    dt = parse_dtype(dtype)
    if model.dtype == dt or any(isinstance(m, QuantLinear) for m in model.modules()):
        return model
    return use_decode_layout(copy.deepcopy(model).to(dt))


def _samples(lm, sec: DistillSection, out: Path, progress: bool = False) -> list[Sample]:
    path, meta = out / "samples.jsonl", out / "samples.inputs.json"
    key = {**_inputs_key(lm, sec), "references": sec.references}
    if sec.more_data:  # (absent without: the key of runs before more_data)
        key["more_data"] = [str(src) for src in sec.more_data]
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()) == key:
        announce(f"reused: {path}")
        return [Sample(**json.loads(x)) for x in path.read_text().splitlines() if x.strip()]
    pairs = load_pairs(sec.data, sec.limit)
    more = [load_pairs(src, field=f"distill.more_data[{i}]") for i, src in enumerate(sec.more_data)]
    gen = _as_dtype(lm.model, sec.gen_dtype)
    prompts = [q for q, _ in pairs]
    shards = _shard_dir(out / "samples", _inputs_key(lm, sec))
    if sec.self_instruct:
        prompts += self_instruct(gen, lm.tokenizer, sec.self_instruct, seed=sec.seed, batch_size=sec.gen_batch_size,
                                 progress=progress, shard_dir=shards, openings=sec.self_instruct_openings)
    sampling = SamplingConfig(temperature=sec.temperature)
    samples = self_distill(gen, lm.tokenizer, prompts, sec.max_new_tokens, sampling, sec.seed, sec.max_prompt_tokens,
                           progress=progress, batch_size=sec.gen_batch_size, shard_dir=shards)
    cut = sec.max_prompt_tokens + sec.max_new_tokens  # a reference sequence's most tokens
    if sec.references:
        samples += reference_samples(lm.tokenizer, pairs, cut)
    for i, (src, extra) in enumerate(zip(sec.more_data, more)):  # after data's: its shards and features stay valid
        folder = _shard_dir(out / "samples" / f"more-{i}", _more_key(lm, sec, src))
        samples += self_distill(gen, lm.tokenizer, [q for q, _ in extra], sec.max_new_tokens, sampling,
                                seed_for(sec.seed, i + 1), sec.max_prompt_tokens, progress=progress,
                                batch_size=sec.gen_batch_size, shard_dir=folder)
        if sec.references:
            samples += reference_samples(lm.tokenizer, extra, cut)
    write_text(path, "".join(json.dumps({"tokens": s.tokens, "n_prompt": s.n_prompt}) + "\n"
                                    for s in samples))
    write_json(meta, key)
    return samples


# the section fields the generated answers depend on (samples.jsonl adds `references` and `more_data`), those of
# them that set how any prompt is answered, and those the cached features add
GENERATION_INPUTS = ("max_new_tokens", "temperature", "max_prompt_tokens", "seed", "gen_batch_size", "gen_dtype")
ANSWER_INPUTS = ("data", "limit", "self_instruct", "self_instruct_openings", *GENERATION_INPUTS)
FEATURE_INPUTS = ("features", "feature_dtype", "feature_layers")


def _inputs_key(lm, sec: DistillSection) -> dict:
    """What the generated answers to `data`'s prompts (and the self-written ones) depend on."""
    return {"model": repr(lm.args), **{k: str(getattr(sec, k)) for k in ANSWER_INPUTS
                                       if getattr(sec, k) != []}}  # no openings: the key of runs before them


def _more_key(lm, sec: DistillSection, src) -> dict:
    """What the answers to a `more_data` set depend on: the set, and how prompts are answered."""
    return {"model": repr(lm.args), "data": str(src), **{k: str(getattr(sec, k)) for k in GENERATION_INPUTS}}


def _shard_dir(folder: Path, key: dict) -> Path:
    """The folder of a generation's shards, made with the settings `key`; shards made with others are removed."""
    meta = folder / "inputs.json"
    if meta.is_file() and json.loads(meta.read_text()) != key:
        stale = sorted(folder.glob("*.jsonl"))
        for p in stale:
            p.unlink()
        announce(f"discarded {len(stale)} generation shard(s) in {folder}: made with other settings")
    if done := sorted(folder.glob("*.jsonl")):
        announce(f"resumed: {len(done)} finished generation shard(s) from {folder}")
    write_json(meta, key)
    return folder


def _with_features(base, samples: list[Sample], sec: DistillSection, folder: Path, layers: list[int],
                   progress: bool = False) -> list[Sample]:
    """Samples carrying the base's features (the outputs of `layers`, then the last layer's), from cached
    shards (computed once, shard by shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    base.use_feature_layers(layers)  # what the head reads (EagleHead.bind sets the same)
    model = _as_dtype(base, sec.feature_dtype)
    key = {"feature_dtype": str(parse_dtype(sec.feature_dtype)), "feature_layers": list(layers)}
    meta = folder / "inputs.json"
    made = {"feature_dtype": "torch.bfloat16", "feature_layers": []}  # what older runs made
    made.update(json.loads(meta.read_text()) if meta.is_file() else {})
    if made != key:  # shards of another feature_dtype or other layers
        stale = sorted(folder.glob("shard-*.safetensors"))
        for p in stale:
            p.unlink()
        if stale:
            announce(f"discarded {len(stale)} feature shard(s) in {folder}: made with another feature_dtype "
                     "or other feature_layers")
    write_json(meta, key)
    if done := sorted(folder.glob("shard-*.safetensors")):
        announce(f"reused: {len(done)} feature shard(s) from {folder}")
    out = []
    for k in range(0, len(samples), SHARD):
        path, part = folder / f"shard-{k // SHARD:05d}.safetensors", samples[k:k + SHARD]
        cached = load_feature_shard(path) if path.is_file() else None
        if cached is not None and [(s.tokens, s.n_prompt) for s in cached] != [(s.tokens, s.n_prompt) for s in part]:
            announce(f"discarded {path}: made from other samples (the answers or the data changed)")
            cached = None
        if cached is None:
            feats = compute_features(model, part, sec.feature_batch_tokens, progress,
                                     desc=f"features {folder.parent.name} {k // SHARD + 1}/{-(-len(samples) // SHARD)}",
                                     dtype=parse_dtype(sec.feature_dtype))  # cached as computed
            save_feature_shard(path, [Sample(s.tokens, s.n_prompt, f) for s, f in zip(part, feats)])
            cached = load_feature_shard(path)
        out += cached
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

    return load_quantized_model(str(_quantized_path(sec, run_dir))).model


def run_distill(lm, sec: DistillSection, out: str | Path, progress: bool = False, run_dir: str | Path | None = None,
                execution: ExecutionContext | None = None, **trainer_overrides) -> dict:
    """lm: a models.loader.LoadedModel (the target); execution: where the heads train (default: the
    target's device). Returns {drafter name: DistillModule}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clean_and_announce(out)
    head_cfg = DrafterConfig.for_base(lm.args, arch=sec.head_arch, draft_vocab_size=sec.draft_vocab_size,
                                      n_layers=sec.head_layers, feature_residual=sec.feature_residual,
                                      feature_layers=sec.feature_layers)
    lm.model.use_feature_layers(head_cfg.feature_layers)  # layers past the model's: ConfigError before any work
    samples = _samples(lm, sec, out, progress)
    if not samples:
        raise ConfigError(f"distill.data: {sec.data} gave no training sequences; pass a file with prompts")
    modules = {}
    for name in sec.drafters:
        base = _base_for(name, lm, sec, Path(run_dir or out.parent))
        data = samples if sec.features == "online" else _with_features(base, samples, sec, out / name / "features",
                                                                       head_cfg.feature_layers, progress)
        modules[name] = fit(base, DistillDataset(data, sec.train.max_len), head_cfg, sec.train, out / name,
                            ctx=execution, **trainer_overrides)
    return modules


def check_inputs(recipe, out: Path, upstream: set[str]) -> None:
    """Every input the stage will read exists and parses, before any model loads (the quantized
    copy only when no earlier stage of this run writes it)."""
    sec = recipe.distill
    load_pairs(sec.data, sec.limit)
    for i, src in enumerate(sec.more_data):
        load_pairs(src, field=f"distill.more_data[{i}]")
    if "quantized" in sec.drafters and "quantize" not in upstream:
        _quantized_path(sec, Path(out))


def run_stage(ctx) -> list[Path]:
    """The stage in `polybasic distill|run`: heads for the shared target (and its quantized copy)."""
    out = ctx.out / "distill"
    out.mkdir(parents=True, exist_ok=True)
    dump_recipe(ctx.recipe, out / "recipe.yaml")
    run_distill(ctx.target, ctx.recipe.distill, out, progress=True, run_dir=ctx.out, execution=ctx.execution,
                enable_progress_bar=True)
    heads = [out / name / "head.safetensors" for name in ctx.recipe.distill.drafters]
    for h in heads:
        print(f"wrote {h}")
    return heads
