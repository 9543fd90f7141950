"""vLLM's side of `polybasic serve-check`, run by the vLLM virtual environment's python:

    .venv-vllm/bin/python -m polybasic.serving.vllm_run REQUEST.json RESULT.json

REQUEST (written by polybasic.serving.check): {"model": HF folder, "prompts": [[token ids], ...],
"max_new_tokens", "stop_token_ids", "speculative_config": null or {"method": "eagle3", "model": DIR,
"num_speculative_tokens": k}, "dtype", "enforce_eager", "warmup", "max_model_len", "kv_cache_bytes",
"seed"}. The prompts are token ids (our chat template, our tokenizer): vLLM never sees text.

RESULT: {"vllm_version", "load_s", "runs": [{"tokens", "wall_s", "spec": {counters of this prompt}}],
"spec": {the counters summed over the timed prompts}}. Greedy, one request at a time, each timed from
`generate` called to its return (prefill included), after `warmup` untimed prompts.

This module runs in a virtual environment holding vllm, torch, transformers and safetensors, and
polybasic installed with --no-deps: it imports vllm and the standard library only (no other polybasic
module). vLLM spawns its engine and worker processes, which import the main module again: the run sits
under `if __name__ == "__main__"`. Threads: the caller sets OMP_NUM_THREADS and VLLM_CPU_OMP_THREADS_BIND.
"""
import json
import sys
import time
from pathlib import Path

import vllm
from vllm import LLM, SamplingParams

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's cumulative spec-decode counters (zeros without speculative decoding)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POS:
            vals = [int(v) for v in m.values]
            prev = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(vals, prev + [0] * (len(vals) - len(prev)))]
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    prev = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev)]
    return d


def run(req: dict) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model=req["model"], tokenizer=req["model"], dtype=req.get("dtype", "float32"),
              speculative_config=req.get("speculative_config"), enforce_eager=bool(req.get("enforce_eager")),
              max_model_len=int(req["max_model_len"]), kv_cache_memory_bytes=int(req["kv_cache_bytes"]),
              enable_prefix_caching=False, disable_log_stats=False, seed=int(req.get("seed", 0)),
              max_num_seqs=1)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_new_tokens"]),
                            stop_token_ids=list(req.get("stop_token_ids") or []), ignore_eos=False)
    prompts = req["prompts"]
    for ids in prompts[:int(req.get("warmup", 1))]:  # untimed
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    runs, first = [], spec_counters(llm)
    for ids in prompts:
        before = spec_counters(llm)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        wall = time.perf_counter() - t
        runs.append({"tokens": [int(x) for x in out[0].outputs[0].token_ids], "wall_s": wall,
                     "spec": delta(spec_counters(llm), before)})
    return {"vllm_version": vllm.__version__, "load_s": load_s, "runs": runs,
            "spec": delta(spec_counters(llm), first)}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m polybasic.serving.vllm_run REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    req = json.loads(Path(argv[0]).read_text())
    result = run(req)
    tmp = Path(argv[1] + ".partial")
    tmp.write_text(json.dumps(result))
    tmp.replace(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
