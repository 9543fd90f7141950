"""`polybasic serve-check`: vLLM serves a bundle's top link (its target and the EAGLE-3 head right under
it, exported in the speculators format), checked against our runtime on the same Spec-Bench prompts.

One run, one request at a time, greedy, the same prompt token ids everywhere (our tokenizer and chat
template; vLLM is handed ids, never text):

1. our runtime, in this process: vanilla (our lean decoder) and the chain [target, head] with the same
   k, interleaved as `polybasic bench` runs methods: greedy tokens, tokens/s, tau;
2. vLLM, twice, each in a subprocess of the vLLM virtual environment's python (`make vllm-check` makes
   `.venv-vllm`; polybasic.serving.vllm_run): vanilla, then `speculative_config={"method": "eagle3",
   "model": BUNDLE/speculators, "num_speculative_tokens": k}`: tokens, tokens/s, vLLM's spec-decode counters;
3. token-for-token identity of every pair, and at each first difference the logits of our target
   there: a near-tie shows as a small gap between the two tokens' logits.

Every check that needs no model (paths, configs, the speculators folder against the target's config,
the vLLM python) runs before anything loads.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from polybasic.artifacts import write_json, write_text
from polybasic.bench.methods import BenchContext, Output, make_runner
from polybasic.bench.questions import load_questions, select
from polybasic.bench.report import machine_info
from polybasic.bench.runner import run_all, summarize
from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError, EngineError, ModelNotFoundError, check
from polybasic.models.eagle_head import load_head
from polybasic.models.loader import load_model, resolve_hf_folder
from polybasic.models.preflight import check_source, read_json, safetensors_header
from polybasic.models.speculators_format import load_speculators
from polybasic.runtime.bundle import SPECULATORS, check_bundle
from polybasic.runtime.chain import Chain
from polybasic.runtime.context import timed
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.hub import resolve_bundle
from polybasic.runtime.levels import ModelLevel
from polybasic.runtime.sampling import make_generator
from polybasic.runtime.text import encode_prompt, eos_ids
from polybasic.serving.compare import (NEAR_TIE, OURS, OURS_CHAIN, OURS_COMPILED, VLLM, VLLM_SPEC, differences,
                                       markdown, summary)

VLLM_VENV = ".venv-vllm"  # what `make vllm-check` creates
VLLM_PYTHON_ENV = "POLYBASIC_VLLM_PYTHON"  # overrides the default vLLM python
WORKER = "polybasic.serving.vllm_run"
FIX_VLLM = f"run `make vllm-check` in the polybasic checkout (it creates {VLLM_VENV}) or pass --vllm-python"
FIX_SPECULATORS = "export the bundle again (`polybasic export`), or pass --speculators DIR"
# tensors every EAGLE-3 speculators checkpoint holds (d2t / t2d too where the draft vocabulary is reduced)
REQUIRED_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight")


@dataclass
class Plan:
    """What a serve-check runs, every path checked."""
    target: str  # the target's model source (what load_model takes)
    dtype: str
    hf_folder: Path | None  # the target's HF folder (None until resolved: a GGUF converts on first use)
    speculators: Path  # the exported EAGLE-3 folder vLLM serves
    head: Path | None  # --head: a head file our chain runs instead of the speculators folder
    k: int
    vllm_python: Path
    questions: list
    out: Path


def default_vllm_python() -> Path:
    """$POLYBASIC_VLLM_PYTHON, else .venv-vllm/bin/python in the current folder, else in the checkout
    this polybasic runs from."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return Path(os.environ[VLLM_PYTHON_ENV])
    here = Path(VLLM_VENV) / "bin" / "python"
    if here.exists():
        return here.absolute()
    return Path(__file__).resolve().parents[2] / VLLM_VENV / "bin" / "python"


def read_speculators_config(folder: Path) -> dict:
    """The speculators folder's config.json, checked to be an EAGLE-3 checkpoint with its tensors
    (headers only)."""
    where = f"speculators: {folder}"
    if not folder.is_dir():
        raise ModelNotFoundError(f"{where}: no such folder; {FIX_SPECULATORS}")
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{where}: has no config.json; {FIX_SPECULATORS}")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: config.json is not valid JSON ({e}); {FIX_SPECULATORS}") from None
    check(isinstance(cfg, dict) and cfg.get("speculators_model_type") == "eagle3",
          f"{where}: config.json: speculators_model_type",
          f"is {cfg.get('speculators_model_type') if isinstance(cfg, dict) else None!r}, vLLM's eagle3 method "
          "needs 'eagle3'", FIX_SPECULATORS)
    layer = cfg.get("transformer_layer_config")
    check(isinstance(layer, dict) and isinstance(layer.get("hidden_size"), int),
          f"{where}: config.json: transformer_layer_config", "is missing or has no hidden_size", FIX_SPECULATORS)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{where}: has no *.safetensors weights; {FIX_SPECULATORS}")
    names = {n for f in files for n in safetensors_header(f, FIX_SPECULATORS) if n != "__metadata__"}
    needed = list(REQUIRED_TENSORS) + (["d2t", "t2d"] if cfg.get("draft_vocab_size") not in
                                       (None, layer.get("vocab_size")) else [])
    missing = [n for n in needed if n not in names] + ([] if any(n.startswith("layers.0.") for n in names)
                                                       else ["layers.0.*"])
    check(not missing, f"{where}: tensors", f"{', '.join(missing)} missing", FIX_SPECULATORS)
    return cfg


def check_against_target(spec_cfg: dict, target_cfg: dict, where: str) -> None:
    """The head was made for this target: hidden size, vocabulary, aux layers inside the target."""
    layer = spec_cfg["transformer_layer_config"]
    for field, want in (("hidden_size", target_cfg.get("hidden_size")), ("vocab_size", target_cfg.get("vocab_size"))):
        got = layer.get(field)
        check(got == want, f"{where}: transformer_layer_config.{field}",
              f"is {got}, the target's is {want}: the head was made for another target",
              "export a head trained on this target")
    n = target_cfg.get("num_hidden_layers")
    aux = spec_cfg.get("eagle_aux_hidden_state_layer_ids") or []
    bad = [i for i in aux if not (isinstance(i, int) and 0 <= i < (n or 0))]
    check(not bad, f"{where}: eagle_aux_hidden_state_layer_ids", f"{bad} are not layers of the target "
          f"(it has {n})", "export a head trained on this target")


def check_hf_folder(folder: Path) -> dict:
    """The target's HF folder as vLLM needs it: config.json with `architectures`."""
    path = folder / "config.json"
    cfg = read_json(path, "model", "vLLM loads Hugging Face folders", "convert the model again")
    check(bool(cfg.get("architectures")), f"model: {path}: architectures",
          "is missing; vLLM picks the model class from it",
          'add e.g. "architectures": ["LlamaForCausalLM"] to it (polybasic writes it when it converts a GGUF)')
    return cfg


def validate(a: argparse.Namespace) -> Plan:
    """Every check that needs no model: bundle, speculators folder, head, k, vLLM python, questions, out."""
    for field, value, low in (("max_new_tokens", a.max_new_tokens, 1), ("warmup", a.warmup, 0),
                              ("k", a.k, 1), ("threads", a.threads, 1), ("timeout", a.timeout, 1)):
        if value is not None and value < low:
            raise ConfigError(f"{field}: must be >= {low}, got {value}; pass --{field.replace('_', '-')} {low} or more")
    if a.ours_compiled and a.warmup < 1:
        raise ConfigError("warmup: --ours-compiled compiles on its first prompt, which must not be timed; pass "
                          "--warmup 1 or more")
    if a.near_tie is not None and a.near_tie < 0:
        raise ConfigError(f"near_tie: must be >= 0, got {a.near_tie}; pass --near-tie {NEAR_TIE}")
    if a.head and a.bundle:
        raise ConfigError("--head: our chain runs the bundle's exported head; drop --head")
    py = Path(a.vllm_python) if a.vllm_python else default_vllm_python()
    if not py.exists():
        raise ModelNotFoundError(f"vllm-python: {py} does not exist; {FIX_VLLM}")
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out: {out} is a file; pass a folder path")
    head, k, dtype = None, a.k, a.dtype
    if a.bundle:
        if a.model:
            raise ConfigError("--model: the bundle names its target; drop --model")
        folder = resolve_bundle(a.bundle)
        m = check_bundle(folder)
        target, dtype = m.target["source"], a.dtype or m.target.get("dtype", "float32")
        top = m.chain.levels[0]
        if top.kind != "eagle":
            raise ConfigError(f"bundle: {folder}: chain: the level right under the target is '{top.name}' "
                              f"({top.kind}); vLLM serves an EAGLE-3 head there: export a bundle whose chain "
                              "has an eagle3 head right under the target")
        # our chain runs the speculators folder, the very weights vLLM serves (the same head as top.path)
        speculators = Path(a.speculators) if a.speculators else folder / SPECULATORS
        k = k or m.decoding.k
    else:
        if not a.speculators:
            raise ConfigError("bundle: none given; pass a bundle folder (or Hub id), or --model and --speculators DIR")
        target = a.model
        if not target:
            raise ConfigError("--model: serving a --speculators folder without a bundle needs its target; pass "
                              "--model")
        head = Path(a.head) if a.head else None
        speculators = Path(a.speculators)
    if head is not None and not head.is_file():
        raise ModelNotFoundError(f"head: {head} does not exist; pass the head's .safetensors file")
    check_source(target, "--model")
    spec_cfg = read_speculators_config(speculators)
    proposals = (spec_cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = k or proposals[0].get("speculative_tokens") or 3
    cats = [c.strip() for c in a.categories.split(",") if c.strip()] if a.categories else None
    questions = select(load_questions(a.questions), a.per_category, cats)
    return Plan(target, dtype or "float32", None, speculators.absolute(), head and head.absolute(), k, py,
                questions, out)


def worker_env(threads: int, vllm_python: Path, preload: bool = True) -> dict:
    """The vLLM worker's environment: `threads` OpenMP threads bound to the first `threads` CPUs this
    process may use (vLLM's auto binding keeps one core for its scheduler: on 2 cores, one thread),
    and Intel OpenMP (and tcmalloc where installed) preloaded as vLLM's CPU backend asks."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus[:threads]),
           "TOKENIZERS_PARALLELISM": "false"}
    if preload:
        libs = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                            vllm_python.parent.parent / "lib" / "libiomp5.so") if p.is_file()]
        if libs:
            env["LD_PRELOAD"] = ":".join([str(p) for p in libs] + [x for x in [env.get("LD_PRELOAD")] if x])
    return env


def run_vllm(plan: Plan, name: str, request: dict, threads: int, timeout: float, preload: bool = True) -> dict:
    """One vLLM run in the vLLM python's subprocess (its own process group: a timeout ends vLLM's engine
    and worker processes too); its log goes to OUT/NAME.log."""
    plan.out.mkdir(parents=True, exist_ok=True)
    req, res, log = (plan.out / f"{name}.request.json", plan.out / f"{name}.result.json", plan.out / f"{name}.log")
    write_json(req, request)
    res.unlink(missing_ok=True)
    cmd = [str(plan.vllm_python), "-m", WORKER, str(req), str(res)]
    env = worker_env(threads, plan.vllm_python, preload)
    print(f"[serve-check: {name}: {shlex.join(cmd)} (log: {log})]", file=sys.stderr)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException as e:  # a timeout, or Ctrl-C here: vLLM's processes go too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, subprocess.TimeoutExpired):
                raise EngineError(f"timeout: vLLM's {name} run took more than {timeout:.0f} s (see {log}); pass "
                                  "a larger --timeout, fewer prompts or --enforce-eager") from None
            raise
    if rc != 0 or not res.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        hint = (f"; {FIX_VLLM}" if "No module named" in tail else "")
        raise EngineError(f"vllm: the {name} run failed (exit {rc}; the end of {log} follows){hint}\n{tail}")
    out = json.loads(res.read_text())
    out["process_s"] = time.perf_counter() - t0
    out["env"] = {k: env[k] for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD") if k in env}
    return out


@torch.inference_mode()
def logit_gap(model, prompt_ids: list[int], prefix: list[int], a: int | None, b: int | None) -> dict:
    """Our target's logits after prompt + prefix: the gap between tokens a and b (either may be None:
    one output ended there), the top-2 gap and the top-2 tokens."""
    ids = list(prompt_ids) + list(prefix)
    model.setup_caches(len(ids) + 1)
    logits, _ = model(torch.tensor([ids], dtype=torch.long, device=model.device), 0, last_only=True)
    row = logits[0, -1].float()
    top = torch.topk(row, 2)
    gap = abs(float(row[a] - row[b])) if a is not None and b is not None else None
    return {"gap": gap, "top2_gap": float(top.values[0] - top.values[1]), "top2": [int(t) for t in top.indices]}


def load_our_head(plan: Plan, lm):
    """The head our chain runs: --head's file, else the speculators folder vLLM serves (the very same
    weights). (head, None), or (None, why) where polybasic's eagle3 layer cannot run that folder."""
    if plan.head is not None:
        return load_head(plan.head, lm.model), None
    try:
        return load_speculators(plan.speculators, base=lm.model), None
    except ConfigError as e:
        return None, str(e)


def chain_runner(ctx: BenchContext, levels: list, k: int):
    """Our chain over `levels` with draft length k, measured as `polybasic bench` measures chains."""
    def run(prompt_ids: list[int], seed: int) -> Output:
        gen = make_generator(seed, ctx.model.device)
        with timed(ctx.model.device) as t:
            chain = Chain(levels, k=k, eos=ctx.eos)
            tokens, stats = chain.generate(prompt_ids, ctx.max_new_tokens, sampling=ctx.sampling, generator=gen)
        link = stats.links[-1]  # per non-empty draft, as vLLM counts its drafts
        accepted = [a for a, d in zip(link.accepted, link.drafted) if d]
        return Output(list(tokens), t.seconds, float(stats.tau) if stats.tau is not None else None, accepted,
                      {f"{link.verifier}<-{link.drafter}": accepted})
    return run


def our_side(plan: Plan, lm, head, prompts: list[tuple], max_new_tokens: int, warmup: int, progress: bool,
             compiled: bool = False) -> tuple:
    """Our vanilla and our chain [target, head] (k = plan.k; skipped without a head), and with `compiled`
    our vanilla-compiled (the one-token step under torch.compile), interleaved as `polybasic bench`
    runs methods: per-prompt runs, tau, accept_len."""
    ctx = BenchContext(lm.model, lm.tokenizer, eos_ids(lm.tokenizer), max_new_tokens, SamplingConfig(),
                       plan.k, source=plan.target, dtype=plan.dtype, gguf=getattr(lm, "gguf_file", None),
                       prompt_tokens=tuple(len(p) for *_, p in prompts))
    runners = {OURS: make_runner("vanilla", ctx)}
    if compiled:
        runners[OURS_COMPILED] = make_runner("vanilla-compiled", ctx)
    if head is not None:
        target = ModelLevel(lm.model, name="target", tokenizer=lm.tokenizer)
        runners[OURS_CHAIN] = chain_runner(ctx, [target, EagleLevel(head, target, name="eagle3")], plan.k)
    records = run_all(runners, prompts, seed=0, warmup=warmup, progress=progress)
    stats = summarize([replace(r, method="vanilla" if r.method == OURS else r.method) for r in records], greedy=True)
    runs = {key: [{"tokens": r.tokens, "wall_s": r.wall_s, "tau": r.tau, "accepted": r.accepted}
                  for r in records if r.method == key] for key in runners}
    chain = stats.get(OURS_CHAIN) or {}
    return runs, chain.get("tau"), chain.get("accept_len")


def our_counters(runs: list[dict]) -> dict:
    """Our chain's drafts and accepted draft tokens, counted as vLLM counts them (non-empty drafts)."""
    acc = [a for r in runs for a in (r.get("accepted") or [])]
    return {"num_drafts": len(acc), "num_accepted_tokens": sum(acc)}


def run_serve_check(a: argparse.Namespace) -> int:
    plan = validate(a)
    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    lm = load_model(plan.target, plan.dtype)
    plan.hf_folder = resolve_hf_folder(plan.target)
    target_cfg = check_hf_folder(plan.hf_folder)
    check_against_target(read_speculators_config(plan.speculators), target_cfg, f"speculators: {plan.speculators}")
    prompts = [(q.question_id, q.category, encode_prompt(lm.tokenizer, q.prompt)) for q in plan.questions]
    eos = sorted(eos_ids(lm.tokenizer))

    head, no_chain = load_our_head(plan, lm)
    if no_chain:
        print(f"[serve-check: our chain skipped: {no_chain}]", file=sys.stderr)
    runs, our_tau, our_accept = our_side(plan, lm, head, prompts, a.max_new_tokens, a.warmup, not a.no_progress,
                                         a.ours_compiled)
    request = {"model": str(plan.hf_folder), "prompts": [p for *_, p in prompts], "max_new_tokens": a.max_new_tokens,
               "stop_token_ids": eos, "dtype": plan.dtype, "enforce_eager": a.enforce_eager, "warmup": a.warmup,
               "max_model_len": max(len(p) for *_, p in prompts) + a.max_new_tokens + plan.k + 8,
               "kv_cache_bytes": int(a.kv_cache_gib * (1 << 30)), "seed": 0, "speculative_config": None}
    vanilla = run_vllm(plan, VLLM, request, threads, a.timeout, not a.no_preload)
    spec_cfg = {"method": "eagle3", "model": str(plan.speculators), "num_speculative_tokens": plan.k}
    spec = run_vllm(plan, VLLM_SPEC, {**request, "speculative_config": spec_cfg}, threads, a.timeout,
                    not a.no_preload)
    runs[VLLM], runs[VLLM_SPEC] = vanilla["runs"], spec["runs"]

    rows = [{"question_id": q, "category": c, "prompt_tokens": len(p)} for q, c, p in prompts]
    outputs = {key: [r["tokens"] for r in rs] for key, rs in runs.items()}
    gaps = []
    for d in differences(rows, outputs):
        x = outputs[d["pair"].split(" vs ")[0]][d["prompt_index"]]
        gaps.append({**d, **logit_gap(lm.model, prompts[d["prompt_index"]][2], x[:d["position"]], *d["tokens"])})
    command = shlex.join(["polybasic", *sys.argv[1:]]) if "serve-check" in sys.argv[1:] else "serve-check"
    machine = machine_info(plan.dtype, command, "cpu")
    doc = summary(rows, runs, k=plan.k, vllm_spec=spec["spec"], our_tau=our_tau, our_accept_len=our_accept,
                  our_spec=our_counters(runs[OURS_CHAIN]) if OURS_CHAIN in runs else None,
                  gaps=gaps, near_tie=NEAR_TIE if a.near_tie is None else a.near_tie, machine=machine,
                  config={"target": plan.target, "hf_folder": str(plan.hf_folder), "dtype": plan.dtype,
                          "speculators": str(plan.speculators),
                          "head": str(plan.head or plan.speculators) if head is not None else None,
                          "our_chain_skipped": no_chain,
                          "bundle": a.bundle, "max_new_tokens": a.max_new_tokens, "threads": threads,
                          "warmup": a.warmup, "enforce_eager": a.enforce_eager,
                          "ours_compiled": a.ours_compiled, "command": command,
                          "questions": a.questions, "per_category": a.per_category},
                  vllm_info={"version": spec.get("vllm_version"), "load_s": {VLLM: vanilla["load_s"],
                                                                            VLLM_SPEC: spec["load_s"]},
                             "process_s": {VLLM: vanilla["process_s"], VLLM_SPEC: spec["process_s"]},
                             "env": spec["env"]})
    write_json(plan.out / "summary.json", doc, indent=2)
    write_text(plan.out / "report.md", markdown(doc))
    print(markdown(doc))
    print(f"[summary: {plan.out / 'summary.json'}; report: {plan.out / 'report.md'}]", file=sys.stderr)
    return 1 if any(v is False for v in doc["checks"].values()) else 0
