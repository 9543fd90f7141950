"""`polybasic bench`: the Spec-Bench speed benchmark's flags (the benchmark itself: polybasic.bench.suite)."""
from __future__ import annotations

import argparse

from polybasic.bench import BUNDLE_METHODS, DEFAULT_METHODS, METHOD_NAMES, PEER_TIMEOUT_S
from polybasic.config import COMPILE_MODES, DEFAULT_MODEL
from polybasic.runtime.chainspec import CHAIN_HELP


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="Spec-Bench speed benchmark (tokens/s, speedup, tau)",
                       description=f"Spec-Bench speed benchmark of decoding methods on one target.\nMethods: {', '.join(METHOD_NAMES)}; vanilla:DTYPE runs our "
                                   f"decoder on the target loaded again in DTYPE; vanilla-dense[:DTYPE] runs it on "
                                   f"a NAME@w4a8 target's weights expanded into DTYPE (default --dtype), without the "
                                   f"codes kernel; hf-assisted:SOURCE[@DTYPE] runs "
                                   f"transformers assisted generation with that assistant (same tokenizer as the "
                                   f"target; DTYPE defaults to --dtype); chain:SPEC runs a chain spelled as for "
                                   f"`generate --chain`; chain alone runs the --bundle's chain; "
                                   f"pld-compiled and chain-compiled[:SPEC] run the same with every level's steps "
                                   f"compiled (their compile time is reported apart); "
                                   f"llamacpp and llamacpp-pld run llama.cpp on the target's own GGUF file, each in "
                                   f"its own process (pip install 'polybasic[peers]'; skipped with a message without "
                                   f"it).\n\nWith --report or --json every measurement is appended to a records file "
                                   f"as it comes (DIR/records.jsonl, or OUT's name with .records.jsonl); --resume "
                                   f"continues a killed run from it.\n\n{CHAIN_HELP}")
    p.add_argument("--bundle", default=None, metavar="PATH|HUB_ID",
                   help="a chain bundle: its target is the model, and method `chain` (no spec) runs its chain "
                        "with its k and thresholds, printing the planned (predicted) speedup beside the "
                        "measured one (default methods then: vanilla,chain)")
    p.add_argument("--reprofile", action="store_true",
                   help="with --bundle: re-measure its levels' costs here and re-plan before benchmarking "
                        "(the predicted speedup is then this machine's)")
    p.add_argument("--model", default=None,
                   help="the target: short name, .gguf file, Hugging Face folder, Hub id or a quantized "
                        f".safetensors copy (default: {DEFAULT_MODEL}, or the --bundle's target)")
    p.add_argument("--questions", default="spec-bench",
                   help="JSON-lines questions {question_id, category, turns}; a missing or empty "
                        "category counts as one category (spec-bench: the shipped Spec-Bench questions)")
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
    p.add_argument("--dtype", default=None, help="dtype of the target's weights (default: float32; bfloat16 for a "
                                                 "NAME@w4a8 target; a --bundle's own)")
    p.add_argument("--device", default="cpu",
                   help="where every method runs: cpu, cuda or cuda:N (the report then names the GPU)")
    p.add_argument("--draft-tokens", type=int, default=8, help="k of the n-gram / prompt-lookup drafts")
    p.add_argument("--step-sizes", default=None, metavar="N,N",
                   help="*-compiled methods: the token counts their steps are compiled for, 1 first, the largest "
                        "the prefill chunk (default: 1,2,4,6,8,12,16,64 on the CPU, 1,16,128 on CUDA); fewer sizes compile faster")
    p.add_argument("--compile-mode", default="layers", choices=COMPILE_MODES,
                   help="*-compiled methods on a CPU: 'layers' compiles one graph per layer and size, shared by every "
                        "layer (seconds); 'whole' one graph of the whole model per size (minutes, steps ~5%% faster)")
    p.add_argument("--thresholds", default=None, metavar="N,N",
                   help="chain:SPEC and chain-compiled:SPEC: how many tokens each middle level accumulates before "
                        "handing them up, one per middle level, top first; a chain with fewer middle levels takes the "
                        "first ones (default: k + 1 each)")
    p.add_argument("--adaptive-k", action="store_true",
                   help="our chains adapt the bottom level's draft length (1..k) to its acceptance")
    p.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                   help="our chains: a drafting level (model or EAGLE head) ends its draft after a token it "
                        "gave a probability below P (lossless) (default: 0, off, or a bundle's for its chain)")
    p.add_argument("--predict", type=int, default=0, metavar="N",
                   help="profile every chain method's levels (T(M), each link's acceptance on the last N records of "
                        "the shipped Alpaca set, never benchmark data) before timing, and print the planner's "
                        "predicted speedup beside the measured one (0: only a bundle's chain has one, its plan's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts per method before timing")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run every method N times on each prompt, the rounds interleaved, and keep the fastest "
                        "run's time (best of N: a shared machine's slow spells hit a run, not a method; every "
                        "run's time stays in the records)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write results JSON")
    p.add_argument("--report", default=None, metavar="DIR", help="write report.md and bench.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run from its records file (the same command, --resume added): only the "
                        "missing (method, prompt) pairs run; a changed option is refused. Without it an earlier "
                        "run's records file is moved aside")
    p.add_argument("--strict", action="store_true",
                   help="exit with code 1 (after writing every output) when a lossless method (chain*, pld*) is "
                        "not token-identical to its reference (vanilla, or vanilla-compiled for compiled ones)")
    p.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S, metavar="SECONDS",
                   help="a peer method (llamacpp*) that takes longer than this to load or to answer a prompt "
                        f"counts as hung: its process is killed and the method reported failed (default: "
                        f"{PEER_TIMEOUT_S:g})")
    p.set_defaults(func=_run)


def _run(a: argparse.Namespace) -> int:
    from polybasic.bench.suite import run_bench_command  # start-up time: torch only when it runs

    return run_bench_command(a)
