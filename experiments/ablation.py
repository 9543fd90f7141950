"""Drafter-quality ablation: each distill lever alone, then the best combination, at
one fixed training budget, every head measured where a chain uses it.

Method. One base recipe (e.g. recipes/smollm2-quick.yaml) fixes the target, the distill data and the
training budget (its `distill` settings: the first `limit` records, max_new_tokens, batch size,
max_len, epochs / steps). Every variant is that recipe plus a few dotted overrides
({"distill.references": false, ...}); the default variants are `baseline` (no override), each lever
of `LEVERS` flipped alone (relative to the base recipe's own value), and `best`, the combination the
user names with --best after reading the single-lever rows. A variant may not touch the budget
(`FIXED`): --budget changes it for every variant at once. Every derived recipe trains only the
target's head (`stages: [distill]`, `distill.drafters: [target]`) into OUT/<variant>.

Before any training, every derived recipe is built, checked by the recipe parser (a bad key or
value raises ConfigError naming the flag and the field), written to OUT/<variant>/recipe.yaml and
read back with `load_recipe`, and the distill inputs are checked (the data exists, and the held-out
prompts lie after the training records).

Then, per variant, in order:
  1. train: `run_recipe(OUT/<variant>/recipe.yaml, only=("distill",))`, the run loop itself, so an
     interrupted run resumes from its shards and checkpoints and a finished one is skipped. Training
     time = the distill stage's wall seconds as the run loop records them (.stages/distill.json:
     answer generation, features and training; a stage resumed after an interruption only counts
     its last run, marked * in the table).
  2. diagnose (experiments.diagnose): step-1 acceptance at the draft starts of a 2-level greedy
     chain [target, head] and the walk's mean accepted length, on the LAST --prompts records of the
     distill data (never training prompts), the target loaded as the bench loads it (model.dtype,
     model.device) generating its own greedy answers (cached in OUT/heldout.json, shared by every
     variant).
  3. bench: `polybasic bench --methods chain:eagle:<head> --draft-tokens k --per-category P
     --max-new-tokens T --temperature t --json ...` in a subprocess, once per temperature (default
     greedy and T=1): tau overall and per Spec-Bench category.
Each step's result is cached in OUT/<variant> (diagnose.json, bench-T*.json, keyed by the training
run and the settings); OUT/<variant>/results.json, written last and atomically, marks the variant
done: a rerun with the same settings skips it. OUT/ablation.md (the command line, one row per
variant, tau per category) is rewritten after every variant.

python -m experiments.ablation --recipe recipes/smollm2-quick.yaml --out runs/d2-ablation \
    [--variants NAME,...] [--best K=V|LEVER,...] [--budget K=V,...] [--extra NAME:K=V,...]
    [--prompts 20] [--per-category 2] [--max-new-tokens 64] [--k 5] [--temperatures 0,1] [--dry-run]
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from polybasic.artifacts import write_text
from polybasic.config import parse_assignments, set_fields
from polybasic.errors import ConfigError, check

RESULTS = "results.json"
TABLE = "ablation.md"
BASELINE, BEST = "baseline", "best"
DRAFT_VOCAB_ON = 16384  # the draft_vocab lever's value when the base recipe uses the full vocabulary
# what every derived recipe runs: the target's head only (the quantized copy's head needs the quantize stage)
COMMON = {"stages": ["distill"], "distill.drafters": ["target"]}
# the fixed training budget and data: a variant may not change them (--budget changes them for all)
FIXED = ("distill.data", "distill.limit", "distill.self_instruct", "distill.max_new_tokens",
         "distill.max_prompt_tokens", "distill.train.batch_size", "distill.train.max_len",
         "distill.train.max_epochs", "distill.train.max_steps")
NOT_A_LEVER = ("model", "out_dir", "stages", "name", "version")  # a variant may not touch these either
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=-]*$")


@dataclass(frozen=True)
class Variant:
    name: str  # OUT/<name>
    overrides: dict  # dotted recipe key -> value, e.g. {"distill.train.regress": "postnorm"}
    flag: str = ""  # the flag that made it (errors name it); "" for the built-in levers


@dataclass
class AblationSpec:
    """One ablation: a base recipe, a fixed budget, the variants and how each head is measured."""

    recipe: str  # the base recipe's path
    out: str  # OUT: OUT/<variant>/ per variant, OUT/ablation.md
    variants: list[Variant]
    budget: dict = field(default_factory=dict)  # dotted overrides for EVERY variant (the base's budget if empty)
    prompts: int = 20  # held-out records (the last N of distill.data) for the diagnostic
    per_category: int = 2  # Spec-Bench questions per category
    max_new_tokens: int = 64  # per prompt, diagnostic and bench alike
    k: int = 5  # draft tokens per round
    temperatures: tuple[float, ...] = (0.0, 1.0)  # one bench per temperature (0: greedy)
    questions: str | None = None  # Spec-Bench questions file (None: the bench's default)
    seed: int = 0  # the bench's sampling seed
    command: str = ""  # the command line, printed atop ablation.md

    def measure_settings(self) -> dict:
        """What a variant's measurements depend on besides its recipe."""
        return {"prompts": self.prompts, "per_category": self.per_category, "max_new_tokens": self.max_new_tokens,
                "k": self.k, "temperatures": list(self.temperatures), "questions": self.questions, "seed": self.seed}


@dataclass
class Planned:
    """A variant ready to run: its folder and its validated recipe (a plain dict and the Recipe)."""

    variant: Variant
    folder: Path
    tree: dict
    recipe: object  # config.Recipe

    @property
    def recipe_path(self) -> Path:
        return self.folder / "recipe.yaml"


# -- overrides ----------------------------------------------------------------------------------

def split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets: "a=1,b=[x,y]" -> ["a=1", "b=[x,y]"]."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_overrides(text: str, flag: str) -> dict:
    """"K=V,K=V" -> {K: V}, each V read as YAML (false, 0, postnorm, [a, b]): `--set`'s syntax."""
    return parse_assignments(split_top(text), flag)


def apply_overrides(tree: dict, overrides: dict, flag: str) -> dict:
    """A deep copy of the (resolved) recipe mapping `tree` with the dotted `overrides` set. Every key
    must name an existing field (else ConfigError naming `flag` and the key)."""
    for key in overrides:
        node, parts = tree, key.split(".")
        for i, part in enumerate(parts):
            where = ".".join(parts[:i]) or "the recipe"
            if not isinstance(node, dict) or part not in node:
                valid = sorted(node) if isinstance(node, dict) else []
                raise ConfigError(f"{flag}: {key} is not a recipe field ({where} has no {part!r}); "
                                  f"fields of {where}: {valid}")
            node = node[part]
    return set_fields(tree, overrides, flag)


def _get(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        node = node[part]
    return node


def check_lever(variant: Variant) -> None:
    """A variant changes levers only: not the fixed budget, the model or where it writes."""
    where = variant.flag or f"variant {variant.name}"
    for key in variant.overrides:
        if key in FIXED or any(key.startswith(f + ".") for f in FIXED):
            raise ConfigError(f"{where}: {key} is part of the fixed training budget; set it for every "
                              f"variant with --budget {key}=...")
        if key.split(".")[0] in NOT_A_LEVER:
            raise ConfigError(f"{where}: {key} is not a drafter lever; every variant shares the base "
                              f"recipe's {key.split('.')[0]}")


# -- variants -----------------------------------------------------------------------------------

def _other_dtype(tree: dict) -> str:
    d = tree["distill"]
    return "bfloat16" if d["gen_dtype"] == d["feature_dtype"] == "float32" else "float32"


def lever_variants(tree: dict) -> list[Variant]:
    """Each lever of the base recipe mapping `tree` flipped alone (a value other than the base's)."""
    d, t = tree["distill"], tree["distill"]["train"]
    dt = _other_dtype(tree)
    out = [Variant(f"dtype-{dt}", {"distill.gen_dtype": dt, "distill.feature_dtype": dt}),  # numerics mismatch
           Variant(f"references-{str(not d['references']).lower()}", {"distill.references": not d["references"]}),
           Variant(f"prompt_loss-{str(not t['prompt_loss']).lower()}",
                   {"distill.train.prompt_loss": not t["prompt_loss"]})]
    out += [Variant(f"regress-{r}", {"distill.train.regress": r})
            for r in ("prenorm", "postnorm", "none") if r != t["regress"]]
    out.append(Variant(f"feature_residual-{str(not d['feature_residual']).lower()}",
                       {"distill.feature_residual": not d["feature_residual"]}))
    vocab = 0 if d["draft_vocab_size"] else DRAFT_VOCAB_ON
    out.append(Variant(f"draft_vocab-{vocab}", {"distill.draft_vocab_size": vocab}))
    return out


LEVERS = ("distill.gen_dtype + distill.feature_dtype", "distill.references", "distill.train.prompt_loss",
          "distill.train.regress", "distill.feature_residual", "distill.draft_vocab_size")  # what lever_variants flips


def best_variant(text: str, levers: list[Variant], flag: str = "--best") -> Variant:
    """--best: KEY=VALUE items and/or lever variant names (their overrides merged), e.g.
    "references-false,distill.train.regress=postnorm"."""
    by_name = {v.name: v for v in levers}
    merged: dict = {}
    for item in split_top(text):
        if "=" in item and item not in by_name:
            part = parse_overrides(item, flag)
        elif item in by_name:
            part = by_name[item].overrides
        else:
            raise ConfigError(f"{flag}: {item!r} is neither KEY=VALUE nor a lever variant; "
                              f"lever variants: {', '.join(by_name)}")
        for k, v in part.items():
            check(merged.get(k, v) == v, flag, f"sets {k} twice ({merged.get(k)!r} and {v!r})", "keep one")
            merged[k] = v
    check(bool(merged), flag, "is empty", "name the levers to combine, e.g. distill.references=false")
    return Variant(BEST, merged, flag)


def extra_variant(text: str, flag: str = "--extra") -> Variant:
    """--extra NAME:K=V,...: one more variant."""
    name, colon, rest = text.partition(":")
    check(bool(colon) and bool(NAME_RE.match(name.strip())), flag, f"{text!r} is not NAME:KEY=VALUE,...",
          "write e.g. gen-fp32:distill.gen_dtype=float32 (NAME: letters, digits, _ . - =)")
    return Variant(name.strip(), parse_overrides(rest, f"{flag} {name.strip()}"), f"{flag} {name.strip()}")


def default_variants(tree: dict, best: str | None = None, extra: list[str] = ()) -> list[Variant]:
    """baseline, each lever alone, the --extra variants, then `best` (when --best names it)."""
    levers = lever_variants(tree)
    out = [Variant(BASELINE, {}), *levers, *(extra_variant(e) for e in extra)]
    if best:
        out.append(best_variant(best, levers))
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    check(not dup, "--extra", f"repeats variant name(s) {dup}", "give each variant its own name")
    return out


def select_variants(variants: list[Variant], names: str | None, flag: str = "--variants") -> list[Variant]:
    """The variants named in `names` ("a,b"; None: all), in the order given."""
    if not names:
        return variants
    by_name = {v.name: v for v in variants}
    wanted = split_top(names)
    for n in wanted:
        if n not in by_name:
            hint = " (pass --best K=V,... to define it)" if n == BEST else ""
            raise ConfigError(f"{flag}: unknown variant {n!r}{hint}; valid: {', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(wanted)]


# -- recipes ------------------------------------------------------------------------------------

def base_tree(recipe_path: str | Path) -> dict:
    """The base recipe as a plain mapping, every default filled in and data paths absolute."""
    from polybasic.config import load_recipe, to_dict

    return _plain(to_dict(load_recipe(recipe_path)))


def _plain(obj):
    """JSON-native copy (tuples become lists), so a stored key compares equal after a round trip."""
    return json.loads(json.dumps(obj))


def derive_tree(base: dict, variant: Variant, budget: dict, folder: Path) -> dict:
    """The variant's recipe mapping: the base, COMMON, the budget, then the variant's overrides;
    out_dir = folder (absolute)."""
    check_lever(variant)
    tree = apply_overrides(base, COMMON, "ablation")
    tree = apply_overrides(tree, budget, "--budget")
    tree = apply_overrides(tree, variant.overrides, variant.flag or f"variant {variant.name}")
    tree["name"] = f"{base['name']}-{variant.name}"
    tree["out_dir"] = str(folder.absolute())
    return tree


def validate_tree(tree: dict, where: str):
    """The recipe parser's verdict on a derived mapping (ConfigError prefixed with `where`)."""
    from polybasic.config import Recipe, from_dict

    try:
        return from_dict(Recipe, copy.deepcopy(tree))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def heldout_prompts(data, limit: int, n: int, flag: str = "--prompts") -> list[str]:
    """The last `n` prompts of `data` (a DataSource), checked to lie after its first `limit` records,
    which the heads train on."""
    from polybasic.drafters.data import load_pairs

    pairs = load_pairs(data, None)
    n_train = len(load_pairs(data, limit))
    check(len(pairs) - n >= n_train, flag,
          f"the last {n} of the {len(pairs)} prompts of {data.path} overlap the {n_train} training prompts "
          f"(distill.limit {limit})", f"use at most {max(0, len(pairs) - n_train)} or lower distill.limit "
          "with --budget")
    return [q for q, _ in pairs[len(pairs) - n:]]


def plan(spec: AblationSpec) -> list[Planned]:
    """Every variant's recipe derived, parsed and its inputs checked, before any work; nothing written."""
    from polybasic.pipelines.run import check_inputs

    check(bool(spec.variants), "--variants", "selects no variant", "name at least one")
    base = base_tree(spec.recipe)
    out = []
    for v in spec.variants:
        check(bool(NAME_RE.match(v.name)), "variant", f"name {v.name!r} is not a folder name",
              "use letters, digits, _ . - =")
        folder = Path(spec.out) / v.name
        bad = sorted(set(str(folder.absolute())) & set(",+:@"))
        check(not bad, "--out", f"{folder.absolute()} holds {''.join(bad)!r}, which `--methods chain:eagle:PATH` "
              "cannot carry", "pick a folder path without , + : @")
        tree = derive_tree(base, v, spec.budget, folder)
        recipe = validate_tree(tree, f"variant {v.name}" + (f" ({v.flag})" if v.flag else ""))
        out.append(Planned(v, folder, tree, recipe))
    for d in {(json.dumps(p.tree["distill"]["data"]), p.recipe.distill.limit): p for p in out}.values():
        check_inputs(d.recipe, d.folder, ("distill",))  # the data exists and parses
        heldout_prompts(d.recipe.distill.data, d.recipe.distill.limit, spec.prompts)
    return out


def write_recipes(planned: list[Planned]) -> None:
    """OUT/<variant>/recipe.yaml, each read back with the recipe loader (as `polybasic run` reads it)."""
    from polybasic.config import load_recipe

    for p in planned:
        text = yaml.safe_dump(p.tree, sort_keys=False)
        if not p.recipe_path.is_file() or p.recipe_path.read_text() != text:
            write_text(p.recipe_path, text)
        load_recipe(p.recipe_path)


# -- the expensive steps (replaced by fakes in tests) --------------------------------------------

def cached(path: Path, key: dict, make: Callable[[], object]):
    """The value stored at `path` under `key`, or make() stored there (atomically)."""
    key = _plain(key)
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return doc["value"]
    except (OSError, ValueError, AttributeError):
        pass
    value = _plain(make())
    write_text(path, json.dumps({"key": key, "value": value}, indent=1) + "\n")
    return value


def train_variant(p: Planned) -> dict:
    """The distill stage of the variant's recipe through the run loop (resumed or skipped as the loop
    decides). Returns {"wall_s": the stage's recorded wall seconds, "partial": True when the recorded
    run resumed an interrupted one (then wall_s undercounts), "run_id", "global_step", "sequences",
    "head"}."""
    from polybasic.pipelines.run import run_recipe, stage_record

    before = (stage_record(p.folder, "distill") or {}).get("run_id")
    reused = _resumed(p.folder)  # an interrupted (or older) run's work the stage may reuse
    run_recipe(p.recipe_path, out_dir=p.folder, only=("distill",))
    rec = stage_record(p.folder, "distill") or {}
    info_path = p.folder / "train.json"
    if rec.get("run_id") != before:  # the stage ran (again) now
        info = {"run_id": rec["run_id"], "wall_s": rec["wall_s"], "partial": reused}
        write_text(info_path, json.dumps(info) + "\n")
    else:
        info = _read_json(info_path)
        if info.get("run_id") != rec.get("run_id"):  # finished by a run this driver did not time
            info = {"run_id": rec.get("run_id"), "wall_s": rec.get("wall_s"), "partial": None}
    head = p.folder / "distill" / "target" / "head.safetensors"
    return {**info, "head": str(head.absolute()), "global_step": _head_step(head),
            "sequences": _count_lines(p.folder / "distill" / "samples.jsonl")}


def data_donor(p: Planned, earlier: list[Planned]) -> tuple[Planned | None, bool]:
    """(an earlier variant whose distill stage made exactly the answers p's would make, whether its
    cached features are p's too) or (None, False): same model and the same data settings."""
    from polybasic.pipelines.distill import ANSWER_INPUTS, FEATURE_INPUTS

    def key(q: Planned, fields) -> str:
        return json.dumps([q.tree["model"], {f: q.tree["distill"].get(f) for f in fields}], sort_keys=True)

    answers = (*ANSWER_INPUTS, "references", "more_data")
    same = [q for q in earlier if key(q, answers) == key(p, answers)
            and (q.folder / "distill" / "samples.jsonl").is_file()]
    full = [q for q in same if key(q, (*answers, *FEATURE_INPUTS)) == key(p, (*answers, *FEATURE_INPUTS))]
    return (full[0], True) if full else ((same[0], False) if same else (None, False))


def share_data(donor: Planned, p: Planned, features: bool) -> list[str]:
    """Hard-link (or copy) the donor's answers (and feature shards) into p's distill folder, where the
    distill stage reuses them as its own (they are keyed by the same inputs); files p has are kept.
    Returns the names of the files shared."""
    import os
    import shutil

    src, dst = donor.folder / "distill", p.folder / "distill"
    names = ["samples.jsonl", "samples.inputs.json"]
    if features:
        names += [str(f.relative_to(src)) for f in sorted((src / "target" / "features").glob("*"))]
    shared = []
    for name in names:
        a, b = src / name, dst / name
        if not a.is_file() or b.exists():
            continue
        b.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(a, b)  # finished files are never rewritten in place (atomic replace), so a link is safe
        except OSError:
            shutil.copy2(a, b)
        shared.append(name)
    return shared


def _resumed(folder: Path) -> bool:
    """Whether the distill stage would find earlier work to reuse (answers, features, a checkpoint)."""
    d = folder / "distill"
    return (d / "samples.jsonl").is_file() or any(d.glob("*/checkpoints/last.ckpt")) or any(
        d.glob("samples/*.jsonl")) or any(d.glob("*/features/shard-*.safetensors"))


def _read_json(path: Path) -> dict:
    """The JSON object at `path`, or {} (missing, damaged, not an object)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _count_lines(path: Path) -> int | None:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return None


def _head_step(head: Path) -> int | None:
    from polybasic.models.preflight import FIX_HEAD, safetensors_metadata

    try:
        return int(safetensors_metadata(head, FIX_HEAD).get("global_step"))
    except (TypeError, ValueError, OSError):
        return None


class Target:
    """The target as the bench loads it (model.source in model.dtype on model.device, 'NAME@w4a8' on its GGUF's
    codes as well), loaded on first use."""

    def __init__(self, model: dict) -> None:
        self.model, self._lm = model, None

    def __call__(self):
        if self._lm is None:
            from polybasic.quant.api import load_any_model

            self._lm = load_any_model(self.model["source"], self.model["dtype"], self.model["device"])
        return self._lm


def heldout_sequences(lm, prompts: list[str], max_new_tokens: int, max_prompt_tokens: int) -> list[list]:
    """[[prompt + the target's greedy answer, n_prompt], ...] for the prompts with a non-empty answer."""
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.text import encode_prompt, eos_ids

    eos, out = eos_ids(lm.tokenizer), []
    for q in prompts:
        ids = encode_prompt(lm.tokenizer, q)[-max_prompt_tokens:]
        answer = list(generate_tokens(lm.model, ids, max_new_tokens, eos=eos))
        if answer and len(ids) >= 2:
            out.append([ids + answer, len(ids)])
    return out


def diagnose_head(lm, head_path: str | Path, sequences: list[list], k: int, max_new_tokens: int) -> dict:
    """experiments.diagnose on the held-out sequences: {"draft_start": ..., "all": ...}."""
    from experiments.diagnose import diagnose
    from polybasic.models.eagle_head import load_head

    head = load_head(head_path, lm.model)
    try:
        return diagnose(lm.model, head, [tuple(s) for s in sequences], k, max_new_tokens)
    finally:
        head.drop_caches()


def bench_argv(model: dict, head: str, temperature: float, spec: AblationSpec, json_path: Path) -> list[str]:
    """The `polybasic bench` command measuring the 2-level chain [target, head] (no warm-up: tau only)."""
    argv = [sys.executable, "-m", "polybasic.cli", "bench", "--model", model["source"], "--dtype", model["dtype"],
            "--device", model["device"], "--methods", f"chain:eagle:{head}", "--draft-tokens", str(spec.k),
            "--per-category", str(spec.per_category), "--max-new-tokens", str(spec.max_new_tokens),
            "--temperature", f"{temperature:g}", "--seed", str(spec.seed), "--warmup", "0", "--no-progress",
            "--json", str(json_path)]
    return argv + (["--questions", spec.questions] if spec.questions else [])


def bench_summary(doc: dict) -> dict:
    """The chain's tau overall and per category from a `polybasic bench --json` document."""
    name = next(m for m in doc["methods"] if m.startswith("chain"))
    m = doc["methods"][name]
    return {"method": name, "tau": m["tau"], "accept_len": m.get("accept_len"),
            "identical_to_vanilla": m.get("identical_to_vanilla"),
            "speedup": m.get("speedup"), "prompts": doc["config"].get("prompts"),
            "per_category": {c: g["tau"] for c, g in m["per_category"].items()}}


def run_bench(model: dict, head: str, temperature: float, spec: AblationSpec, json_path: Path) -> dict:
    argv = bench_argv(model, head, temperature, spec, json_path)
    rc = subprocess.run(argv).returncode
    if rc != 0:
        raise RuntimeError(f"bench failed (exit {rc}): {shlex.join(argv)}")
    return bench_summary(json.loads(json_path.read_text()))


def temp_label(t: float) -> str:
    return f"T={t:g}"


def measure_variant(spec: AblationSpec, p: Planned, train: dict, target: Target, say=print) -> dict:
    """Diagnostic and bench of the variant's head; each step cached in its folder, keyed by the
    training run (a retrained head is measured again) and the settings."""
    model, d = p.tree["model"], p.recipe.distill
    base_key = {"run_id": train["run_id"], "model": model, **spec.measure_settings()}
    seq_key = {"model": model, "data": p.tree["distill"]["data"], "limit": d.limit, "prompts": spec.prompts,
               "max_new_tokens": spec.max_new_tokens, "max_prompt_tokens": d.max_prompt_tokens}

    def sequences():  # [[tokens, n_prompt], ...]
        say(f"  held-out answers: the target's greedy answers to the last {spec.prompts} prompts")
        return heldout_sequences(target(), heldout_prompts(d.data, d.limit, spec.prompts), spec.max_new_tokens,
                                 d.max_prompt_tokens)

    def diag():
        say(f"  diagnose: {len(seqs)} held-out answers, k={spec.k}")
        return diagnose_head(target(), train["head"], seqs, spec.k, spec.max_new_tokens)

    seqs = cached(Path(spec.out) / "heldout.json", seq_key, sequences)
    report = cached(p.folder / "diagnose.json", base_key, diag)
    return {"diagnose": report, "bench": bench_head(model, train["head"], spec, p.folder, base_key, say, "  ")}


def bench_head(model: dict, head: str, spec: AblationSpec, folder: Path, key: dict, say=print,
               tag: str = "") -> dict:
    """{"T=t": bench_summary} of the chain [target, head] at each of spec.temperatures; each cached in
    folder/bench-T=t.json under `key` plus the temperature (the raw bench JSON beside it)."""
    out = {}
    for t in spec.temperatures:
        label = temp_label(t)

        def bench_at(t=t, label=label):
            say(f"{tag}bench {label}: {spec.per_category} question(s) per category")
            return run_bench(model, head, t, spec, folder / f"bench-{label}.raw.json")

        out[label] = cached(folder / f"bench-{label}.json", {**key, "temperature": t}, bench_at)
    return out


# -- the report ---------------------------------------------------------------------------------

def _fmt(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def format_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def format_overrides(overrides: dict) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in overrides.items()) or "-"


def _delta(x, ref) -> str:
    return "-" if x is None or ref is None else f"{x - ref:+.3f}"


def render_markdown(command: str, header: list[str], variants: list[Variant], results: dict[str, dict | None],
                    temperatures: tuple[float, ...]) -> str:
    """ablation.md: the command, the setting lines, one row per variant (pending: no results yet),
    then tau per category at each temperature."""
    labels = [temp_label(t) for t in temperatures]
    ref = results.get(BASELINE) or {}
    ref_tau = {lab: ((ref.get("bench") or {}).get(lab) or {}).get("tau") for lab in labels}
    cols = ["variant", "overrides", "train s", "steps", "step-1 @ draft starts", "walk tau"]
    for lab in labels:
        cols += [f"tau {lab}", f"vs baseline {lab}"]
    lines = ["# Drafter-quality ablation", "", "```", command, "```", "", *header, "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for v in variants:
        r = results.get(v.name)
        if r is None:
            lines.append(f"| {v.name} | {format_overrides(v.overrides)} | pending |" + " |" * (len(cols) - 3))
            continue
        tr, ds = r["train"], r["diagnose"]["draft_start"]
        wall = _fmt(tr.get("wall_s"), 1) + ("*" if tr.get("partial") else "") + (
            f" (data of {tr['data_from']})" if tr.get("data_from") else "")
        row = [v.name, format_overrides(v.overrides), wall, str(tr.get("global_step") or "-"), _fmt(ds["step1"]),
               _fmt(ds["mean_accepted_length"])]
        for lab in labels:
            tau = r["bench"][lab]["tau"]
            row += [_fmt(tau), "-" if v.name == BASELINE else _delta(tau, ref_tau[lab])]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "train s: wall seconds of the distill stage (answers, features, training; * resumed after an "
              "interruption: its last run only; 'data of V': the answers (and features) of variant V, made with "
              "the same data settings, were reused, so the seconds are training's). step-1 @ draft starts: the head's first draft token agreeing "
              "with the target at the positions a greedy [target, head] chain drafts from; walk tau: that "
              "chain's mean accepted length on the held-out prompts (experiments.diagnose). tau T=t: "
              "`polybasic bench` on Spec-Bench at temperature t (new tokens per target forward, the prefill "
              "included); vs baseline: its difference from the baseline row's. steps: the head's optimizer "
              "steps (at a fixed epoch budget they follow the number of training sequences)."]
    lines += category_tables(labels, {v.name: r["bench"] for v in variants if (r := results.get(v.name))})
    return "\n".join(lines) + "\n"


def category_tables(labels: list[str], benches: dict[str, dict]) -> list[str]:
    """Markdown lines: per temperature label, one row of Spec-Bench tau per category for each
    {variant name: {label: bench_summary(...)}} (in order)."""
    lines: list[str] = []
    for lab in labels:
        cats = list(dict.fromkeys(c for b in benches.values() for c in b[lab]["per_category"]))
        if not cats:
            continue
        lines += ["", f"## tau per Spec-Bench category, {lab}" + (" (greedy)" if lab == "T=0" else ""), "",
                  "| variant | " + " | ".join(cats) + " |", "|" + "---|" * (len(cats) + 1)]
        for name, b in benches.items():
            per = b[lab]["per_category"]
            lines.append(f"| {name} | " + " | ".join(_fmt(per.get(c)) for c in cats) + " |")
    return lines


def header_lines(spec: AblationSpec, tree: dict) -> list[str]:
    """The settings atop ablation.md; tree: a derived recipe mapping (the budget is every variant's)."""
    d, base = tree["distill"], tree  # base: what every variant shares
    budget = ", ".join(f"{k}={format_value(_get(tree, k))}" for k in FIXED if k != "distill.data")
    return [f"Base recipe `{spec.recipe}`: target {base['model']['source']} ({base['model']['dtype']}, "
            f"{base['model']['device']}); head of the target only; data {d['data']['path']}.",
            f"Fixed budget (every variant): {budget}" + (f"; --budget {format_overrides(spec.budget)}"
                                                          if spec.budget else "") + ".",
            f"Diagnostic: the last {spec.prompts} records of the data (never trained on), k={spec.k}, "
            f"{spec.max_new_tokens} new tokens. Bench: {spec.per_category} question(s) per Spec-Bench category, "
            f"k={spec.k}, {spec.max_new_tokens} new tokens, temperatures "
            f"{', '.join(f'{t:g}' for t in spec.temperatures)}, seed {spec.seed}."]


# -- the driver ---------------------------------------------------------------------------------

def results_key(spec: AblationSpec, p: Planned) -> dict:
    """What a variant's results.json depends on: its derived recipe and the measurement settings."""
    return _plain({"recipe": p.tree, "measure": spec.measure_settings()})


def load_results(p: Planned, key: dict) -> dict | None:
    """The variant's finished results, or None (missing, or made with other settings)."""
    r = _read_json(p.folder / RESULTS)
    return r if r.get("key") == key else None


def _elapsed(s: float) -> str:
    return f"{int(s // 3600)}:{int(s % 3600 // 60):02d}:{int(s % 60):02d}"


def run_ablation(spec: AblationSpec, say=print) -> dict[str, dict]:
    """Every variant trained and measured (finished ones skipped); returns {name: results}."""
    planned = plan(spec)  # every recipe validated before any work
    write_recipes(planned)
    out = Path(spec.out)
    results: dict[str, dict | None] = {}
    for p in planned:
        results[p.variant.name] = load_results(p, results_key(spec, p))
        if results[p.variant.name] is None and (p.folder / RESULTS).is_file():
            say(f"[{p.variant.name}] results.json was made with other settings: measuring again")

    def report() -> None:
        write_text(out / TABLE, render_markdown(spec.command, header_lines(spec, planned[0].tree),
                                                [p.variant for p in planned], results, spec.temperatures))

    report()
    target, t0 = Target(planned[0].tree["model"]), time.perf_counter()
    for i, p in enumerate(planned, 1):
        tag = f"[ablation {i}/{len(planned)} {p.variant.name}]"
        if results[p.variant.name] is not None:
            say(f"{tag} skipped: {p.folder / RESULTS} exists ({_elapsed(time.perf_counter() - t0)} elapsed)")
            continue
        say(f"{tag} {format_overrides(p.variant.overrides)}: distill ({_elapsed(time.perf_counter() - t0)} elapsed)")
        donor, features = data_donor(p, planned[:i - 1])
        if donor is not None and share_data(donor, p, features):
            say(f"{tag} reusing the answers{' and features' if features else ''} of {donor.variant.name} "
                "(same data settings)")
        train = train_variant(p)
        if donor is not None:
            train["data_from"] = donor.variant.name + ("" if features else " (answers)")
        say(f"{tag} trained: {_fmt(train.get('wall_s'), 1)} s recorded; measuring "
            f"({_elapsed(time.perf_counter() - t0)} elapsed)")
        measured = measure_variant(spec, p, train, target, say)
        res = {"variant": p.variant.name, "overrides": p.variant.overrides, "key": results_key(spec, p),
               "train": train, **measured}
        write_text(p.folder / RESULTS, json.dumps(_plain(res), indent=1) + "\n")
        results[p.variant.name] = _plain(res)
        report()
        ds = res["diagnose"]["draft_start"]
        taus = ", ".join(f"tau {lab} {_fmt(b['tau'])}" for lab, b in res["bench"].items())
        say(f"{tag} done: step-1 {_fmt(ds['step1'])}, walk tau {_fmt(ds['mean_accepted_length'])}, {taus} "
            f"({_elapsed(time.perf_counter() - t0)} elapsed)")
    say(f"wrote {out / TABLE}")
    return results


# -- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.ablation", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Drafter-quality ablation: each distill lever alone, then --best, at the base "
                    "recipe's training budget; training time, step-1 acceptance at draft starts, bench tau per "
                    f"category. Levers: {'; '.join(LEVERS)}. Resumable: rerun the same command.")
    ap.add_argument("--recipe", required=True, help="the base recipe (its model, distill data and budget)")
    ap.add_argument("--out", default="runs/d2-ablation", help="output folder: OUT/<variant>/, OUT/ablation.md")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variant names to run, in this order (none: all; --dry-run lists them)")
    ap.add_argument("--best", default=None, metavar="K=V|LEVER,...",
                    help="the `best` variant: dotted recipe overrides and/or lever variant names, e.g. "
                         "distill.references=false,regress-postnorm (choose it after the single-lever rows)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME:K=V,...",
                    help="one more variant (repeatable), e.g. gen-fp32:distill.gen_dtype=float32")
    ap.add_argument("--budget", default=None, metavar="K=V,...",
                    help="overrides for every variant, e.g. distill.limit=160,distill.train.max_steps=200 "
                         "(none: the base recipe's budget)")
    ap.add_argument("--prompts", type=int, default=20, help="held-out records (the data's last N) for the diagnostic")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (diagnostic and bench)")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated bench temperatures (0: greedy)")
    ap.add_argument("--questions", default=None, help="Spec-Bench questions JSONL (none: the bench's default)")
    ap.add_argument("--seed", type=int, default=0, help="the bench's sampling seed")
    ap.add_argument("--dry-run", action="store_true",
                    help="derive, validate and list every variant's recipe, then stop (writes nothing)")
    return ap


def parse_temperatures(text: str, flag: str = "--temperatures") -> tuple[float, ...]:
    try:
        ts = tuple(float(x) for x in split_top(text))
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a comma-separated list of numbers; use e.g. 0,1") from None
    check(bool(ts) and all(t >= 0 for t in ts), flag, f"is {text!r}", "use numbers >= 0, e.g. 0,1")
    return ts


def spec_from_args(a: argparse.Namespace, argv: list[str]) -> AblationSpec:
    for flag, value in (("--prompts", a.prompts), ("--per-category", a.per_category),
                        ("--max-new-tokens", a.max_new_tokens), ("--k", a.k)):
        check(value >= 1, flag, f"must be >= 1, got {value}", "use a positive int")
    tree = base_tree(a.recipe)
    variants = select_variants(default_variants(tree, a.best, a.extra), a.variants)
    return AblationSpec(recipe=a.recipe, out=a.out, variants=variants,
                        budget=parse_overrides(a.budget, "--budget") if a.budget else {}, prompts=a.prompts,
                        per_category=a.per_category, max_new_tokens=a.max_new_tokens, k=a.k,
                        temperatures=parse_temperatures(a.temperatures), questions=a.questions, seed=a.seed,
                        command=shlex.join(["python", "-m", "experiments.ablation", *argv]))


def main(argv: list[str] | None = None) -> int:
    from polybasic.errors import PolybasicError

    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    try:
        spec = spec_from_args(a, argv)
        if a.dry_run:
            for p in plan(spec):
                print(f"{p.variant.name}: {format_overrides(p.variant.overrides)} -> {p.recipe_path}")
            return 0
        print(spec.command, flush=True)
        run_ablation(spec, say=lambda s: print(s, flush=True))
    except PolybasicError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
