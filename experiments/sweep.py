"""Training-lever sweep on one distill run's cached features: no answers or features are made again.

The ablation driver (experiments.ablation) re-runs the distill stage per variant, so it can
change how the data is made (dtype, references, ...). Levers of the training alone (learning rate,
epochs, training-time test, noise, prompt loss, head shape) and the amount of data only need the
features a finished run cached: this sweep trains one target head per variant on them, with the
recipe's own TrainConfig and head settings plus the variant's overrides, and measures each head
with the ablation's diagnostic (step-1 acceptance at the draft starts of a greedy 2-level chain and
the walk's mean accepted length, on the last --prompts records of distill.data: never training
prompts). With --bench T,... each head is also measured where the product uses it: `polybasic bench`
with the 2-level chain [target, head] on Spec-Bench at each temperature (the ablation's bench: tau
overall and per category). Per variant it writes OUT/<name>/head.safetensors, OUT/<name>/result.json
and OUT/<name>/bench-T=t.json (each step is skipped on a rerun with the same settings); OUT/sweep.md
holds the table.

A variant is NAME:KEY=VALUE,... with keys
  train.FIELD     a TrainConfig field (lr, max_epochs, ttt_steps, noise_std, prompt_loss, ...)
  head.FIELD      a DrafterConfig field (draft_vocab_size, n_layers, feature_residual)
  data.fraction   train on this random fraction of the sequences (seed 0): the data curve
  data.first      train on the first N sequences (the generated answers come before the references)
  data.features   feature folders to train on instead of the run's own (a list; their samples must
                  come from the same target with the same feature_layers)

python -m experiments.sweep --recipe runs/d2x/pool/distill/recipe.yaml --out runs/d2-sweep \
    --variant base: --variant lr1e-2-ep4:train.lr=0.01,train.max_epochs=4 [--prompts 20] [--k 5] \
    [--bench 0,1 --per-category 1 --bench-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from experiments.ablation import (
    NAME_RE,
    AblationSpec,
    Target,
    _fmt,
    bench_head,
    cached,
    category_tables,
    diagnose_head,
    heldout_prompts,
    heldout_sequences,
    parse_overrides,
    parse_temperatures,
    temp_label,
)
from polybasic.artifacts import write_text
from polybasic.errors import ConfigError, check

DATA_KEYS = ("fraction", "first", "features")


@dataclass(frozen=True)
class SweepVariant:
    name: str
    train: dict  # TrainConfig overrides
    head: dict  # DrafterConfig overrides
    data: dict  # fraction / first / features


def parse_variant(text: str, flag: str = "--variant") -> SweepVariant:
    """NAME:KEY=VALUE,... (NAME: alone is the recipe's own settings)."""
    name, colon, rest = text.partition(":")
    check(bool(colon) and bool(NAME_RE.match(name.strip())), flag, f"{text!r} is not NAME:KEY=VALUE,...",
          "write e.g. lr1e-2:train.lr=0.01 (NAME: letters, digits, _ . - =)")
    parts: dict[str, dict] = {"train": {}, "head": {}, "data": {}}
    for key, value in (parse_overrides(rest, f"{flag} {name}") if rest.strip() else {}).items():
        group, dot, field_name = key.partition(".")
        check(group in parts and bool(field_name), f"{flag} {name}", f"{key} is not train.*, head.* or data.*",
              "write e.g. train.lr=0.01, head.n_layers=2 or data.fraction=0.5")
        parts[group][field_name] = value
    bad = set(parts["data"]) - set(DATA_KEYS)
    check(not bad, f"{flag} {name}", f"data.{sorted(bad)[0] if bad else ''} is not a data key",
          f"use one of {', '.join('data.' + k for k in DATA_KEYS)}")
    return SweepVariant(name.strip(), parts["train"], parts["head"], parts["data"])


def configs(recipe, v: SweepVariant):
    """The variant's (DrafterConfig, TrainConfig): the recipe's distill settings with its overrides;
    a bad field raises ConfigError naming the variant."""
    from polybasic.models.eagle_head import DrafterConfig
    from polybasic.models.loader import folder_and_args
    from polybasic.models.preflight import split_kernel

    sec = recipe.distill
    where = f"--variant {v.name}"
    try:
        train = replace(sec.train, **v.train)
        head = DrafterConfig.for_base(folder_and_args(split_kernel(recipe.model.source)[0])[1], **{
            "draft_vocab_size": sec.draft_vocab_size, "n_layers": sec.head_layers,
            "feature_residual": sec.feature_residual, "feature_layers": sec.feature_layers, **v.head})
    except TypeError as e:
        valid = "TrainConfig" if "TrainConfig" in str(e) or v.train else "DrafterConfig"
        raise ConfigError(f"{where}: {e} (not a {valid} field)") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return head, train


def training_samples(folders: list[Path], data: dict) -> list:
    """The cached feature samples of `folders`, cut as data.first / data.fraction say."""
    from polybasic.drafters.data import load_feature_shard

    shards = [p for f in folders for p in sorted(Path(f).glob("shard-*.safetensors"))]
    check(bool(shards), "data.features", f"no feature shards in {', '.join(map(str, folders))}",
          "run the recipe's distill stage first (features: cache)")
    samples = [s for p in shards for s in load_feature_shard(p)]
    if "first" in data:
        samples = samples[:int(data["first"])]
    if "fraction" in data:
        frac = float(data["fraction"])
        check(0 < frac <= 1, "data.fraction", f"must be in (0, 1], got {frac}", "use e.g. 0.5")
        random.Random(0).shuffle(samples)
        samples = samples[:int(len(samples) * frac)]
    return samples


def run_variant(recipe, run_out: Path, v: SweepVariant, out: Path, sequences: list, target: Target,
                k: int, max_new_tokens: int, bench: AblationSpec | None = None, say=print) -> dict:
    """Train (unless OUT/<name>/head.safetensors was made with the same settings), diagnose and, with
    `bench` (its k, per_category, max_new_tokens, temperatures, questions, seed), bench the head."""
    from polybasic.drafters.data import DistillDataset
    from polybasic.drafters.module import fit

    head_cfg, train_cfg = configs(recipe, v)
    folders = [Path(f) for f in v.data.get("features", [run_out / "distill" / "target" / "features"])]
    folder = out / v.name
    key = {"head": asdict(head_cfg), "train": asdict(train_cfg), "data": {**v.data, "features": list(map(str, folders))},
           "k": k, "max_new_tokens": max_new_tokens, "heldout": len(sequences)}

    def train() -> dict:
        samples = training_samples(folders, v.data)
        say(f"[{v.name}] training on {len(samples)} sequences ({sum(len(s.tokens) for s in samples)} tokens)")
        lm = target()
        t0 = time.perf_counter()
        fit(lm.model, DistillDataset(samples, train_cfg.max_len), head_cfg, train_cfg, folder, resume=False,
            enable_progress_bar=sys.stderr.isatty())
        return {"train_s": time.perf_counter() - t0, "sequences": len(samples),
                "tokens": sum(len(s.tokens) for s in samples)}

    trained = cached(folder / "train.json", {k2: key[k2] for k2 in ("head", "train", "data")}, train)
    rep = cached(folder / "result.json", key,
                 lambda: diagnose_head(target(), folder / "head.safetensors", sequences, k, max_new_tokens))
    ds, al = rep["draft_start"], rep["all"]
    benches = {} if bench is None else bench_head(
        target.model, str(folder / "head.safetensors"), bench, folder,
        {**key, "trained": trained, **bench.measure_settings()}, say, f"[{v.name}] ")
    return {**trained, "step1": ds["step1"], "tau": ds["mean_accepted_length"], "depth": ds["depth_rate"],
            "tf_step1": al["step1"], "coverage": ds["draft_vocab_coverage"], "bench": benches}


def render(command: str, variants: list[SweepVariant], rows: dict[str, dict], labels: list[str] = ()) -> str:
    """sweep.md: the command, one row per variant (diagnostic, then Spec-Bench tau per temperature
    label), then tau per Spec-Bench category at each label."""
    cols = ["variant", "overrides", "sequences", "train s", "step-1 at draft starts", "P(depth 2 ok)",
            "mean accepted length (k drafts)", "teacher-forced step 1", "draft-vocab coverage",
            *(f"Spec-Bench tau {lab}" for lab in labels)]
    lines = [f"`{command}`", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for v in variants:
        r = rows.get(v.name)
        over = ", ".join(f"{g}.{k}={val}" for g in ("train", "head", "data") for k, val in getattr(v, g).items())
        if r is None:
            lines.append(f"| {v.name} | {over or '(recipe)'} |" + " - |" * (len(cols) - 2))
            continue
        d2 = r["depth"][1] if len(r["depth"]) > 1 else None
        cells = [v.name, over or "(recipe)", str(r["sequences"]), _fmt(r["train_s"], 0), _fmt(r["step1"]), _fmt(d2),
                 _fmt(r["tau"]), _fmt(r["tf_step1"]), _fmt(r["coverage"]),
                 *(_fmt(r["bench"][lab]["tau"]) for lab in labels)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += category_tables(list(labels), {n: r["bench"] for n, r in rows.items()})
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from polybasic.config import load_recipe

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", required=True, help="the recipe of a run whose distill stage cached features")
    ap.add_argument("--out", required=True, help="OUT/<variant>/ per variant, OUT/sweep.md")
    ap.add_argument("--variant", action="append", required=True, help="NAME:KEY=VALUE,... (repeatable)")
    ap.add_argument("--prompts", type=int, default=20, help="held-out records: the last N of distill.data")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="the target's answer per held-out prompt")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round")
    ap.add_argument("--bench", default=None, metavar="T,...",
                    help="also bench each head on Spec-Bench at these temperatures (0: greedy), e.g. 0,1")
    ap.add_argument("--per-category", type=int, default=1, help="with --bench: Spec-Bench questions per category")
    ap.add_argument("--bench-tokens", type=int, default=64, help="with --bench: new tokens per question")
    ap.add_argument("--questions", default=None, help="with --bench: Spec-Bench questions JSONL (none: the default)")
    ap.add_argument("--seed", type=int, default=0, help="with --bench: the bench's sampling seed")
    a = ap.parse_args(argv)
    for flag, value in (("--prompts", a.prompts), ("--k", a.k), ("--per-category", a.per_category),
                        ("--bench-tokens", a.bench_tokens)):
        check(value >= 1, flag, f"must be >= 1, got {value}", "use a positive int")
    bench = None if a.bench is None else AblationSpec(
        recipe=a.recipe, out=a.out, variants=[], per_category=a.per_category, max_new_tokens=a.bench_tokens, k=a.k,
        temperatures=parse_temperatures(a.bench, "--bench"), questions=a.questions, seed=a.seed)
    recipe = load_recipe(a.recipe)
    variants = [parse_variant(t) for t in a.variant]
    check(len({v.name for v in variants}) == len(variants), "--variant", "names a variant twice", "rename one")
    for v in variants:
        configs(recipe, v)  # every bad field before any work
    out = Path(a.out)
    sec, target = recipe.distill, Target({"source": recipe.model.source, "dtype": recipe.model.dtype,
                                          "device": recipe.model.device})
    prompts = heldout_prompts(sec.data, sec.limit, a.prompts)
    sequences = cached(out / "heldout.json", {"prompts": prompts, "max_new_tokens": a.max_new_tokens},
                       lambda: heldout_sequences(target(), prompts, a.max_new_tokens, sec.max_prompt_tokens))
    command = "python -m experiments.sweep " + " ".join(map(shlex.quote, argv))
    rows: dict[str, dict] = {}
    for v in variants:
        rows[v.name] = run_variant(recipe, Path(recipe.out_dir), v, out, sequences, target, a.k,
                                   a.max_new_tokens, bench)
        print(json.dumps({"variant": v.name, **{k: rows[v.name][k] for k in ("train_s", "step1", "tau")},
                          **{f"bench {lab}": b["tau"] for lab, b in rows[v.name]["bench"].items()}}), flush=True)
        write_text(out / "sweep.md", render(command, variants, rows,
                                            [temp_label(t) for t in bench.temperatures] if bench else []))
    print((out / "sweep.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
