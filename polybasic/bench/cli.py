"""`polybasic bench`: Spec-Bench speed benchmark of decoding methods on one target."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from polybasic.errors import ConfigError

DEFAULT_METHODS = "vanilla,hf,hf-pld,pld"


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="Spec-Bench speed benchmark (tokens/s, speedup, tau)",
                       description=__doc__)
    p.add_argument("--bundle", default=None, help="a polybasic bundle (arrives with a later version)")
    p.add_argument("--model", default="smollm2-135m", help="short name, .gguf file, HF folder or Hub id")
    p.add_argument("--questions", default=None,
                   help="JSON-lines questions {question_id, category, turns} "
                        "(default ../shared/data/spec_bench/question.jsonl)")
    p.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated (default {DEFAULT_METHODS}); vanilla always runs as reference")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-tokens", type=int, default=8, help="k of the n-gram / prompt-lookup drafts")
    p.add_argument("--adaptive-k", action="store_true",
                   help="our chains adapt the bottom level's draft length (1..k) to its acceptance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts per method before timing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write results JSON")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.md and bench.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_bench_command)


def _command_line(a: argparse.Namespace) -> str:
    if "bench" in sys.argv[1:]:
        return shlex.join(["polybasic", *sys.argv[1:]])
    opts = {k: v for k, v in vars(a).items() if k not in ("func", "command", "verbose") and v not in
            (None, False)}  # called programmatically: rebuild from the parsed options
    flags = {"json_out": "--json"}
    parts = ["polybasic", "bench"]
    for k, v in opts.items():
        parts += [flags.get(k, "--" + k.replace("_", "-"))] + ([] if v is True else [str(v)])
    return shlex.join(parts)


def _validate(a: argparse.Namespace):
    """Every check that needs no model, so bad input fails before anything heavy loads."""
    from polybasic.bench.methods import parse_methods
    from polybasic.bench.questions import load_questions, select
    from polybasic.runtime.sampling import SamplingConfig

    if a.bundle is not None:
        raise ConfigError("bundle: bundles arrive with a later version of polybasic bench; "
                          "use --model NAME for now")
    methods = parse_methods(a.methods)
    sampling = SamplingConfig(a.temperature, a.top_k, a.top_p)
    for field, value, low in (("max_new_tokens", a.max_new_tokens, 1), ("warmup", a.warmup, 0),
                              ("draft_tokens", a.draft_tokens, 1), ("threads", a.threads, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{field}: must be >= {low}, got {value}; pass --{field.replace('_', '-')} "
                              f"{low} or more")
    compiled = [m for m in methods if m.startswith("vanilla-compiled")]
    if compiled and a.warmup < 1:
        raise ConfigError(f"warmup: {compiled[0]} compiles on its first prompt, which must not be timed; "
                          "pass --warmup 1 or more")
    if a.json_out and Path(a.json_out).is_dir():
        raise ConfigError(f"json: {a.json_out} is a folder; pass a file path such as {a.json_out}/bench.json")
    if a.report and Path(a.report).exists() and not Path(a.report).is_dir():
        raise ConfigError(f"report: {a.report} is a file; pass a folder path")
    cats = [c.strip() for c in a.categories.split(",") if c.strip()] if a.categories else None
    questions = select(load_questions(a.questions), a.per_category, cats)
    return methods, sampling, questions


def run_bench_command(a: argparse.Namespace) -> int:
    methods, sampling, questions = _validate(a)

    import torch

    from polybasic.bench.methods import BenchContext, make_runner
    from polybasic.bench.report import machine_info, text_table, write_outputs
    from polybasic.bench.runner import run_all
    from polybasic.models import load_hf_model, load_model
    from polybasic.runtime.text import encode_prompt, eos_ids

    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model, a.dtype)
    prompts = [(q.question_id, q.category, encode_prompt(lm.tokenizer, q.prompt)) for q in questions]
    ctx = BenchContext(lm.model, lm.tokenizer, eos_ids(lm.tokenizer), a.max_new_tokens, sampling,
                       a.draft_tokens, source=a.model, adaptive_k=a.adaptive_k,
                       max_prompt_tokens=max(len(p) for *_, p in prompts), gguf=lm.gguf_file,
                       hf_loader=lambda: load_hf_model(a.model, a.dtype))
    runners = {m: make_runner(m, ctx) for m in methods}
    records = run_all(runners, prompts, seed=a.seed, warmup=a.warmup, progress=not a.no_progress)
    doc = build_document(records, sampling.greedy, machine_info(a.dtype, _command_line(a)), {
        "model": a.model, "questions": a.questions or "default Spec-Bench", "prompts": len(prompts),
        "categories": list(dict.fromkeys(q.category for q in questions)),
        "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_k": a.top_k,
        "top_p": a.top_p, "draft_tokens": a.draft_tokens, "adaptive_k": a.adaptive_k, "seed": a.seed,
        "warmup": a.warmup})
    write_outputs(doc, a.json_out, a.report)
    print(text_table(doc))
    for label, path in (("json", a.json_out), ("report", a.report and Path(a.report) / "report.md")):
        if path:
            print(f"[{label}: {path}]", file=sys.stderr)
    return 0


def build_document(records, greedy: bool, machine: dict, config: dict) -> dict:
    """The --json document: machine, methods (the contract's schema), plus config and per-prompt rows."""
    from polybasic.bench.runner import summarize

    rows = [{k: v for k, v in r.__dict__.items() if k != "tokens"} for r in records]
    return {"machine": machine, "methods": summarize(records, greedy), "config": config, "records": rows}
