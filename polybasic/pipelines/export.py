"""The `export` stage: the plan's best chain as a bundle folder (runtime.bundle), with the profile and
plan it came from, the machine it was measured on and the resolved recipe. `polybasic export RECIPE
--format speculators` (run_speculators) writes the target's eagle3 head alone, in the speculators
format that vLLM serves."""
from __future__ import annotations

import json
from pathlib import Path

from polybasic.bench.report import machine_info
from polybasic.config import load_recipe, to_dict
from polybasic.models.loader import load_tokenizer, resolve_hf_folder
from polybasic.pipelines.profile import chain_spelling
from polybasic.pipelines.run import require
from polybasic.runtime.bundle import SPECULATORS, Decoding, export_bundle, export_speculators
from polybasic.runtime.chainspec import parse_chain_spec


def check_inputs(recipe, out: Path, upstream: set[str]) -> None:
    require(out, "plan.json", "plan", upstream, "export")


def plan_summary(row: dict, compiled: bool = False) -> dict:
    """What the manifest keeps of the chosen plan row; compiled: the profile timed compiled steps (the predicted
    speedup is then over compiled plain decoding, for the chain run compiled)."""
    return {"chain": row["spec"], "levels": row["chain"], "k": row["k"], "thresholds": row["thresholds"],
            "predicted_speedup": row["speedup"], "predicted_speedup_lemma": row["speedup_lemma"],
            "predicted_ms_per_token": row["ms_per_token"], "tau": row["tau"], "compiled": compiled,
            "model": "measured-curve model (polybasic.planner.cost)"}


def run_stage(ctx) -> list[Path]:
    import yaml

    out, recipe = ctx.out, ctx.recipe
    plan = json.loads((out / "plan.json").read_text())
    best = plan["rows"][0]
    spec = parse_chain_spec(chain_spelling(best["chain"], out), "plan.json best chain")
    sec = recipe.profile
    profile = json.loads((out / "profile.json").read_text())
    decoding = Decoding(k=best["k"], thresholds=tuple(best["thresholds"]) or None,
                        temperature=sec.temperature, top_p=sec.top_p,
                        draft_confidence=recipe.export.draft_confidence)
    toks = {lv.name: load_tokenizer(resolve_hf_folder(lv.source)) for lv in spec.levels if lv.kind == "model"}
    folder = out / recipe.export.folder
    export_bundle(folder, recipe.model.source, recipe.model.dtype, spec, decoding, ctx.target.tokenizer,
                  profile=profile, plan={**plan_summary(best, profile.get("compiled", False)),
                                         "candidates": len(plan["rows"])},
                  recipe_yaml=yaml.safe_dump(to_dict(recipe), sort_keys=False),
                  machine=machine_info(recipe.model.dtype, f"polybasic run {ctx.recipe_path}", recipe.model.device),
                  level_tokenizers=toks)
    print(f"wrote {folder} (chain {best['spec']}, predicted {best['speedup']:.2f}x)")
    return [folder / "manifest.json"]


HEAD = "distill/target/head.safetensors"  # the distill stage's head for the recipe's model


def run_speculators(recipe_path: str | Path, out_dir: str | Path | None = None,
                    overrides: tuple[str, ...] = ()) -> Path:
    """The target's head (distill/target/head.safetensors, an eagle3 head) as <out>/speculators: the
    folder vLLM serves with speculative_config {"method": "eagle3", "model": it}; k: profile.k."""
    recipe = load_recipe(recipe_path, overrides)
    out = Path(out_dir or recipe.out_dir)
    require(out, HEAD, "distill", set(), "export --format speculators")
    folder = export_speculators(out / SPECULATORS, out / HEAD, recipe.model.source, recipe.profile.k)
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": recipe.profile.k}
    print(f"wrote {folder}; serve it: vllm serve TARGET --speculative-config '{json.dumps(spec)}'")
    return folder
