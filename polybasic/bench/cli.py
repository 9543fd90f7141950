"""`polybasic bench`: Spec-Bench speed benchmark of decoding methods on one target."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from polybasic.errors import ConfigError

DEFAULT_METHODS = "vanilla,hf,hf-pld,pld"
BUNDLE_METHODS = "vanilla,chain"
MODEL_DEFAULT = "smollm2-135m"
METHOD_NAMES = ("vanilla", "vanilla:DTYPE", "vanilla-compiled", "vanilla-compiled:DTYPE", "vanilla-compiled-dense",
                "vanilla-compiled-dense:DTYPE", "hf", "hf-pld",
                "hf-assisted:SOURCE[@DTYPE]", "pld", "chain:SPEC", "chain")


def add_parser(sub) -> None:
    from polybasic.runtime.chainspec import CHAIN_HELP

    p = sub.add_parser("bench", help="Spec-Bench speed benchmark (tokens/s, speedup, tau)",
                       description=f"{__doc__}\nMethods: {', '.join(METHOD_NAMES)}; vanilla:DTYPE runs our "
                                   f"decoder on the target loaded again in DTYPE; hf-assisted:SOURCE[@DTYPE] runs "
                                   f"transformers assisted generation with that assistant (same tokenizer as the "
                                   f"target; DTYPE defaults to --dtype); chain:SPEC runs a chain spelled as for "
                                   f"`generate --chain`; chain alone runs the --bundle's chain.\n\n{CHAIN_HELP}")
    p.add_argument("--bundle", default=None, metavar="PATH|HUB_ID",
                   help="a chain bundle: its target is the model, and method `chain` (no spec) runs its chain "
                        "with its k and thresholds, printing the planned (predicted) speedup beside the "
                        "measured one (default methods then: vanilla,chain)")
    p.add_argument("--reprofile", action="store_true",
                   help="with --bundle: re-measure its levels' costs here and re-plan before benchmarking "
                        "(the predicted speedup is then this machine's)")
    p.add_argument("--model", default=None,
                   help="the target: short name, .gguf file, Hugging Face folder, Hub id or a quantized "
                        f".safetensors copy (default: {MODEL_DEFAULT}, or the --bundle's target)")
    p.add_argument("--questions", default=None,
                   help="JSON-lines questions {question_id, category, turns}; a missing or empty "
                        "category counts as one category (default: ../shared/data/spec_bench/question.jsonl)")
    p.add_argument("--per-category", type=int, default=None,
                   help="first N questions of each category (default: all)")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated methods (see above); vanilla always runs as the reference "
                        f"(default: {DEFAULT_METHODS}; with --bundle: {BUNDLE_METHODS})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--dtype", default="float32", help="dtype of the target's weights")
    p.add_argument("--device", default="cpu",
                   help="where every method runs: cpu, cuda or cuda:N (the report then names the GPU)")
    p.add_argument("--draft-tokens", type=int, default=8, help="k of the n-gram / prompt-lookup drafts")
    p.add_argument("--adaptive-k", action="store_true",
                   help="our chains adapt the bottom level's draft length (1..k) to its acceptance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts per method before timing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
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


def _check_chains(methods: str) -> None:
    """The chain:SPEC methods' specs and files, checked before torch is imported."""
    from polybasic.runtime.chainspec import check_chain_files, parse_chain_spec

    for name in methods.split(","):
        base, colon, arg = name.strip().partition(":")
        if base == "chain" and arg:
            flag = f"--methods chain:{arg}"
            check_chain_files(parse_chain_spec(arg, flag), flag)


def _validate(a: argparse.Namespace):
    """Every check that needs no model, so bad input fails before anything heavy loads."""
    bundle = _check_bundle(a)
    a.methods = a.methods or (BUNDLE_METHODS if bundle else DEFAULT_METHODS)
    _check_chains(a.methods)

    from polybasic.bench.methods import parse_methods
    from polybasic.bench.questions import load_questions, select
    from polybasic.models.prepare import check_compilable
    from polybasic.models.preflight import check_source
    from polybasic.runtime.context import check_device
    from polybasic.runtime.sampling import SamplingConfig

    device = check_device(a.device, "--device")
    methods = parse_methods(a.methods)
    if "chain" in methods and bundle is None:
        raise ConfigError("methods: 'chain' without a spec runs a bundle's chain; pass --bundle, or spell the "
                          "chain as chain:SPEC")
    sampling = SamplingConfig(a.temperature, a.top_k, a.top_p)
    for field, value, low in (("max_new_tokens", a.max_new_tokens, 1), ("warmup", a.warmup, 0),
                              ("draft_tokens", a.draft_tokens, 1), ("threads", a.threads, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{field}: must be >= {low}, got {value}; pass --{field.replace('_', '-')} "
                              f"{low} or more")
    compiled = [m for m in methods if m.startswith("vanilla-compiled")]
    if compiled:
        check_compilable(device, f"--methods {compiled[0]}")
    if compiled and a.warmup < 1:
        raise ConfigError(f"warmup: {compiled[0]} compiles on its first prompt, which must not be timed; "
                          "pass --warmup 1 or more")
    if a.json_out and Path(a.json_out).is_dir():
        raise ConfigError(f"json: {a.json_out} is a folder; pass a file path such as {a.json_out}/bench.json")
    if a.report and Path(a.report).exists() and not Path(a.report).is_dir():
        raise ConfigError(f"report: {a.report} is a file; pass a folder path")
    cats = [c.strip() for c in a.categories.split(",") if c.strip()] if a.categories else None
    questions = select(load_questions(a.questions), a.per_category, cats)
    if check_source(a.model, "--model") == "quantized":
        again = [m for m in methods if m.startswith("vanilla") and ":" in m]
        if again:
            raise ConfigError(f"methods: '{again[0]}' loads the target again in another dtype, but a quantized "
                              "copy runs in the dtype it was saved with; drop it")
    return methods, sampling, questions


def _check_bundle(a: argparse.Namespace):
    """The --bundle's manifest, checked with every file it names (no model loads); sets --model and
    --dtype to its target's."""
    if a.bundle is None:
        if a.reprofile:
            raise ConfigError("--reprofile: re-plans a bundle's chain; pass --bundle")
        a.model = a.model or MODEL_DEFAULT
        return None
    if a.model is not None:
        raise ConfigError("--bundle: the bundle names its target; drop --model")
    from polybasic.runtime.bundle import check_bundle
    from polybasic.runtime.hub import resolve_bundle

    m = check_bundle(resolve_bundle(a.bundle))
    a.model, a.dtype = m.target["source"], m.target.get("dtype", "float32")
    return m


def run_bench_command(a: argparse.Namespace) -> int:
    methods, sampling, questions = _validate(a)

    import torch

    from polybasic.models import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    bundle = None
    if a.bundle:
        from polybasic.runtime.bundle import load

        bundle = load(a.bundle, a.device, verify_target=False, reprofile=a.reprofile)  # checked by _validate
        lm = bundle.target
    else:
        lm = load_model(a.model, a.dtype, a.device)
    run_bench(a, methods, sampling, questions, lm, bundle)
    return 0


def run_bench(a: argparse.Namespace, methods: list[str], sampling, questions, lm, bundle=None) -> dict:
    """Benchmark `methods` on the loaded target `lm` (and a loaded bundle); writes --json / --report,
    prints the table; returns the document."""
    from polybasic.bench.methods import BenchContext, make_runner
    from polybasic.bench.report import machine_info, peak_rss_mib, text_table, write_outputs
    from polybasic.bench.runner import run_all
    from polybasic.models import load_hf_model
    from polybasic.runtime.text import encode_prompt, eos_ids

    prompts = [(q.question_id, q.category, encode_prompt(lm.tokenizer, q.prompt)) for q in questions]
    ctx = BenchContext(lm.model, lm.tokenizer, eos_ids(lm.tokenizer), a.max_new_tokens, sampling,
                       a.draft_tokens, source=a.model, dtype=a.dtype, adaptive_k=a.adaptive_k,
                       max_prompt_tokens=max(len(p) for *_, p in prompts), gguf=lm.gguf_file,
                       hf_loader=lambda: load_hf_model(a.model, a.dtype, lm.model.device), bundle=bundle)
    runners = {m: make_runner(m, ctx) for m in methods}
    records = run_all(runners, prompts, seed=a.seed, warmup=a.warmup, progress=not a.no_progress)
    predicted = {"chain": bundle.predicted_speedup} if bundle else {}
    machine = machine_info(a.dtype, _command_line(a), lm.model.device)  # names the GPU on CUDA
    machine["peak_rss_mib"] = peak_rss_mib()  # the whole process, every method's models loaded
    doc = build_document(records, sampling.greedy, machine, predicted, {
        "model": a.model, "bundle": a.bundle, "questions": a.questions or "default Spec-Bench", "prompts": len(prompts),
        "categories": list(dict.fromkeys(q.category for q in questions)),
        "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_k": a.top_k,
        "top_p": a.top_p, "draft_tokens": a.draft_tokens, "adaptive_k": a.adaptive_k, "seed": a.seed,
        "warmup": a.warmup})
    write_outputs(doc, a.json_out, a.report)
    print(text_table(doc))
    for label, path in (("json", a.json_out), ("report", a.report and Path(a.report) / "report.md")):
        if path:
            print(f"[{label}: {path}]", file=sys.stderr)
    return doc


def build_document(records, greedy: bool, machine: dict, predicted: dict, config: dict) -> dict:
    """The --json document: machine, methods (the contract's schema), plus config and per-prompt rows.
    predicted: {method: the plan's predicted speedup} (a bundle's chain)."""
    from polybasic.bench.runner import fastest_vanilla, summarize

    rows = [{k: v for k, v in r.__dict__.items() if k != "tokens"} for r in records]
    methods = summarize(records, greedy, predicted)
    return {"machine": machine, "methods": methods, "fastest_vanilla": fastest_vanilla(methods),
            "config": config, "records": rows}
