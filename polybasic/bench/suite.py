"""The Spec-Bench benchmark run from its options (`polybasic bench`, the recipes' bench stage): every
check that needs no model first, then the target (or a bundle), every method interleaved on the
same prompts, the JSON document, the report and its plot."""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from polybasic.bench import BUNDLE_METHODS, DEFAULT_METHODS
from polybasic.bench.identity import add_identity, not_identical
from polybasic.bench.methods import BenchContext, make_runner, parse_methods
from polybasic.bench.peers import MethodFailed
from polybasic.bench.predict import held_out_prompts, predict_chains
from polybasic.bench.questions import load_questions, select
from polybasic.bench.records import RunLog, open_log, records_path
from polybasic.bench.report import machine_info, peak_rss_mib, text_table, write_outputs
from polybasic.bench.runner import fastest_vanilla, run_all, summarize
from polybasic.config import DEFAULT_MODEL, SamplingConfig, check_draft_confidence, int_list
from polybasic.errors import ConfigError
from polybasic.models import load_hf_model
from polybasic.models.preflight import check_source, default_dtype
from polybasic.models.prepare import check_compilable
from polybasic.models.static import check_sizes
from polybasic.planner.replan import reprofile
from polybasic.quant.api import load_any_model
from polybasic.runtime.bundle import MANIFEST, check_bundle, load
from polybasic.runtime.chainspec import check_chain_files, parse_chain_spec
from polybasic.runtime.context import check_device
from polybasic.runtime.hub import resolve_bundle
from polybasic.runtime.text import encode_prompt, eos_ids


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

    for name in methods.split(","):
        base, colon, arg = name.strip().partition(":")
        if base == "chain" and arg:
            flag = f"--methods chain:{arg}"
            check_chain_files(parse_chain_spec(arg, flag), flag)


def validate(a: argparse.Namespace):
    """Every check that needs no model, so bad input fails before anything heavy loads."""
    bundle = _check_bundle(a)
    a.dtype = a.dtype or default_dtype(a.model)
    a.methods = a.methods or (BUNDLE_METHODS if bundle else DEFAULT_METHODS)
    _check_chains(a.methods)

    device = check_device(a.device, "--device")
    methods = parse_methods(a.methods)
    if "chain" in methods and bundle is None:
        raise ConfigError("methods: 'chain' without a spec runs a bundle's chain; pass --bundle, or spell the "
                          "chain as chain:SPEC")
    sampling = SamplingConfig(a.temperature, a.top_k, a.top_p)
    a.thresholds = int_list(a.thresholds, "--thresholds")
    a.step_sizes = int_list(a.step_sizes, "--step-sizes")
    if a.step_sizes:
        check_sizes(a.step_sizes, "--step-sizes")
    for field, value, low in (("max_new_tokens", a.max_new_tokens, 1), ("warmup", a.warmup, 0),
                              ("repeat", a.repeat, 1),
                              ("draft_tokens", a.draft_tokens, 1), ("threads", a.threads, 1),
                              ("predict", getattr(a, "predict", 0), 0)):
        if value is not None and value < low:
            raise ConfigError(f"{field}: must be >= {low}, got {value}; pass --{field.replace('_', '-')} "
                              f"{low} or more")
    if a.draft_confidence is not None:
        check_draft_confidence(a.draft_confidence, "draft_confidence")
    if a.peer_timeout <= 0:
        raise ConfigError(f"peer_timeout: must be > 0 seconds, got {a.peer_timeout}; pass --peer-timeout 600 "
                          "or another positive number")
    compiled = [m for m in methods if "-compiled" in m.split(":", 1)[0]]
    if compiled:
        check_compilable(device, f"--methods {compiled[0]}")
    if a.json_out and Path(a.json_out).is_dir():
        raise ConfigError(f"json: {a.json_out} is a folder; pass a file path such as {a.json_out}/bench.json")
    if a.report and Path(a.report).exists() and not Path(a.report).is_dir():
        raise ConfigError(f"report: {a.report} is a file; pass a folder path")
    cats = [c.strip() for c in a.categories.split(",") if c.strip()] if a.categories else None
    questions = select(load_questions(a.questions), a.per_category, cats)
    if check_source(a.model, "--model") == "quantized":
        again = [m for m in methods if m.startswith("vanilla") and (":" in m or m.startswith("vanilla-dense"))]
        if again:
            raise ConfigError(f"methods: '{again[0]}' loads the target again in another dtype or without its "
                              "kernel, but a quantized copy runs in the dtype and kernels it was saved with; drop it")
    return methods, sampling, questions


def _check_bundle(a: argparse.Namespace):
    """The --bundle's manifest, checked with every file it names (no model loads); sets --model and
    --dtype to its target's."""
    if a.bundle is None:
        if a.reprofile:
            raise ConfigError("--reprofile: re-plans a bundle's chain; pass --bundle")
        a.model = a.model or DEFAULT_MODEL
        return None
    if a.model is not None:
        raise ConfigError("--bundle: the bundle names its target; drop --model")

    m = check_bundle(resolve_bundle(a.bundle))
    a.model, a.dtype = m.target["source"], m.target.get("dtype", "float32")
    return m


# every option that changes a run's results (besides methods, prompts and a bundle's manifest): --resume
# continues a run only when all of them are unchanged
RESULT_FIELDS = ("model", "bundle", "dtype", "device", "threads", "questions", "categories", "per_category",
                 "max_new_tokens", "temperature", "top_k", "top_p", "seed", "warmup", "repeat", "draft_tokens",
                 "adaptive_k", "draft_confidence", "thresholds", "step_sizes", "compile_mode", "reprofile")


def run_header(a: argparse.Namespace, methods: list[str], questions) -> dict:
    """The records file's header config: RESULT_FIELDS, the methods, a hash of the selected questions and
    with --bundle one of its manifest."""
    config = {k: getattr(a, k) for k in RESULT_FIELDS}
    config["methods"] = methods
    config["prompts_sha256"] = _sha256(json.dumps([[q.question_id, q.category, q.prompt] for q in questions]).encode())
    if a.bundle:
        config["bundle_manifest_sha256"] = _sha256((resolve_bundle(a.bundle) / MANIFEST).read_bytes())
    return config


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_run_log(a: argparse.Namespace, methods: list[str], questions, restart_changed: bool = False) -> RunLog:
    """The run's records file (--report / --json), fresh or with --resume continued; refused before any model
    loads when --resume's command differs (restart_changed: start over instead)."""
    return open_log(records_path(a.report, a.json_out), run_header(a, methods, questions), a.resume, restart_changed)


def run_bench_command(a: argparse.Namespace) -> int:
    methods, sampling, questions = validate(a)
    log = open_run_log(a, methods, questions)

    if a.threads:
        torch.set_num_threads(a.threads)
    bundle = None
    if a.bundle:

        bundle = load(a.bundle, a.device, verify_target=False)  # checked by _validate
        if a.reprofile:

            reprofile(bundle)
        lm = bundle.target
    else:
        lm = load_any_model(a.model, a.dtype, a.device)
    doc = run_bench(a, methods, sampling, questions, lm, bundle, log)
    differ = not_identical(doc)
    if a.strict and differ:
        print(f"[--strict: {', '.join(differ)} not identical to its reference (the warnings under the table); "
              "exit code 1]", file=sys.stderr)
        return 1
    return 0


def run_bench(a: argparse.Namespace, methods: list[str], sampling, questions, lm, bundle=None,
              log: RunLog | None = None) -> dict:
    """Benchmark `methods` on the loaded target `lm` (and a loaded bundle), each measurement appended to
    the run's records file as it comes (`log`, default opened from `a`; a resumed run measures only what it
    lacks); writes --json / --report, prints the table; returns the document."""
    if log is None:
        log = open_run_log(a, methods, questions)
    prompts = [(q.question_id, q.category, encode_prompt(lm.tokenizer, q.prompt)) for q in questions]
    ctx = BenchContext(lm.model, lm.tokenizer, eos_ids(lm.tokenizer), a.max_new_tokens, sampling,
                       a.draft_tokens, source=a.model, dtype=a.dtype, adaptive_k=a.adaptive_k,
                       draft_confidence=a.draft_confidence,
                       thresholds=a.thresholds, step_sizes=a.step_sizes, compile_mode=a.compile_mode,
                       prompt_tokens=tuple(len(p) for *_, p in prompts), gguf=lm.gguf_file,
                       hf_loader=lambda: load_hf_model(a.model, a.dtype, lm.model.device), bundle=bundle,
                       peer_timeout=a.peer_timeout)
    runners = _make_runners(methods, ctx, log, prompts)
    # the plan's prediction: the bundle's chain run as its profile timed it (compiled steps: chain-compiled)
    predicted = {"chain-compiled" if bundle.manifest.planned_compiled else "chain": bundle.predicted_speedup} \
        if bundle else {}
    if getattr(a, "predict", 0):
        chains = {m: r.chain for m, r in runners.items() if hasattr(r, "chain") and m not in predicted}
        predicted.update(predict_chains(chains, held_out_prompts(lm.tokenizer, a.predict), ctx.eos, sampling,
                                        a.max_new_tokens, lambda s: print(s, file=sys.stderr)))
    try:
        run_all(runners, prompts, seed=a.seed, warmup=a.warmup, progress=not a.no_progress, order=methods,
                done=log.done(), on_record=log.record, on_failure=log.failure, repeat=a.repeat)
    finally:
        for r in runners.values():
            getattr(r, "close", lambda: None)()  # peers' processes end
        log.close()
    machine = machine_info(a.dtype, _command_line(a), lm.model.device)  # names the GPU on CUDA
    machine["peak_rss_mib"] = peak_rss_mib()  # the whole process, every method's models loaded
    doc = build_document(log.records, sampling.greedy, machine, predicted, {
        "model": a.model, "bundle": a.bundle, "questions": a.questions or "spec-bench", "prompts": len(prompts),
        "categories": list(dict.fromkeys(q.category for q in questions)),
        "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_k": a.top_k,
        "top_p": a.top_p, "draft_tokens": a.draft_tokens, "thresholds": a.thresholds, "step_sizes": a.step_sizes,
        "compile_mode": a.compile_mode, "adaptive_k": a.adaptive_k,
        "draft_confidence": a.draft_confidence,
        "seed": a.seed,
        "warmup": a.warmup, "repeat": a.repeat}, log.compile_s, log.failures)
    write_outputs(doc, a.json_out, a.report)
    print(text_table(doc))
    for label, path in (("json", a.json_out), ("report", a.report and Path(a.report) / "report.md"),
                        ("records", log.path)):
        if path:
            print(f"[{label}: {path}]", file=sys.stderr)
    return doc


def _make_runners(methods: list[str], ctx: BenchContext, log: RunLog, prompts) -> dict:
    """The runners of the methods with prompts left to measure (a resumed run's finished or failed methods
    get none, and load nothing); a peer that fails to load is logged as failed; compile times are logged."""
    runners = {}
    for m in log.pending(methods, prompts):
        before = dict(ctx.compile_s)
        try:
            runners[m] = make_runner(m, ctx)
        except MethodFailed as e:
            log.failure(replace(e.failure, method=m, stage="load"))
        for k, seconds in ctx.compile_s.items():
            if before.get(k) != seconds:
                log.compiled(k, seconds)
    return runners


def build_document(records, greedy: bool, machine: dict, predicted: dict, config: dict,
                   compile_s: dict | None = None, failures: dict | None = None) -> dict:
    """The --json document: machine, methods (the contract's schema), plus config and per-prompt rows.
    predicted: {method: the plan's predicted speedup} (a bundle's chain); compile_s: {method: seconds its
    compiled steps took to compile and warm, before any timed prompt}; failures: {method: peers.Failure},
    listed under "failed" and left out of "methods" (their figures would cover only some prompts). A lossless
    method of a greedy run carries "identity_reference" and "mismatches" (polybasic.bench.identity)."""

    failures = failures or {}
    rows = [{k: v for k, v in r.__dict__.items() if k != "tokens"} for r in records]
    kept = [r for r in records if r.method not in failures]
    methods = summarize(kept, greedy, predicted)
    add_identity(methods, kept, greedy)
    for m, seconds in (compile_s or {}).items():
        if m in methods:
            methods[m]["compile_s"] = seconds
    return {"machine": machine, "methods": methods, "fastest_vanilla": fastest_vanilla(methods),
            "failed": {m: asdict(f) for m, f in failures.items()}, "config": config, "records": rows}
