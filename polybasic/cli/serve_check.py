"""`polybasic serve-check`: vLLM serves a bundle's top link (target + EAGLE-3 head), checked against our
runtime (the check itself: polybasic.serving.check; vLLM's side runs in `make vllm-check`'s .venv-vllm)."""
from __future__ import annotations

import argparse

from polybasic.serving.compare import NEAR_TIE


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve-check",
        help="vLLM serving a bundle's target + EAGLE-3 head beside our runtime (identity, tau, tokens/s)",
        description="Run vLLM (in the virtual environment `make vllm-check` creates, .venv-vllm) on the same "
                    "Spec-Bench prompts as our bench, vanilla and with the bundle's EAGLE-3 head exported in the "
                    "speculators format (speculative_config method eagle3), one request at a time, greedy; run "
                    "our runtime's vanilla and chain [target, head] with the same k beside it. Reports tokens/s "
                    "of all four, vLLM's acceptance length beside our tau, token-for-token identity of every pair "
                    "and, at each first difference, our target's logit gap there (a near-tie). Writes "
                    "OUT/summary.json (keys prompts, identical, vllm_acceptance, our_tau, tokens_per_s, checks) "
                    "and OUT/report.md; exits 1 when a check fails.")
    p.add_argument("bundle", nargs="?", default=None, metavar="BUNDLE",
                   help="a chain bundle (folder or Hub id) whose chain has an EAGLE-3 head right under the "
                        "target, exported with its speculators/ folder")
    p.add_argument("--speculators", default=None, metavar="DIR",
                   help="the speculators-format folder vLLM serves (default: BUNDLE/speculators); without a "
                        "bundle, with --model")
    p.add_argument("--model", default=None,
                   help="without a bundle: the target (short name, .gguf file, Hugging Face folder, Hub id)")
    p.add_argument("--head", default=None, metavar="PATH",
                   help="without a bundle: our chain's head file (eagle:PATH); without it our chain is skipped")
    p.add_argument("--k", type=int, default=None,
                   help="draft tokens per step, for vLLM and our chain (default: the bundle's k, else the "
                        "speculators config's)")
    p.add_argument("--questions", default="spec-bench", help="JSON-lines questions (spec-bench: the shipped ones)")
    p.add_argument("--per-category", type=int, default=1, help="first N questions of each category")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--dtype", default=None, help="the target's dtype, ours and vLLM's (default: the bundle's, "
                                                 "else float32)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of our runtime and of vLLM's worker (default: every core)")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts per run before timing")
    p.add_argument("--ours-compiled", action="store_true",
                   help="also run our vanilla-compiled (the one-token step under torch.compile, as vLLM compiles "
                        "its model): the fair speed peer of vLLM's compiled vanilla")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM without torch.compile (starts in ~20 s instead of ~90 s; slower decoding)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache size")
    p.add_argument("--near-tie", type=float, default=None,
                   help=f"the largest logit gap that counts as a near-tie (default: {NEAR_TIE})")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="the python of the virtual environment holding vLLM (default: $POLYBASIC_VLLM_PYTHON, "
                        "else .venv-vllm/bin/python here or in the polybasic checkout)")
    p.add_argument("--no-preload", action="store_true",
                   help="do not LD_PRELOAD Intel OpenMP (and tcmalloc) into vLLM as its CPU backend asks")
    p.add_argument("--timeout", type=int, default=1800, help="seconds each vLLM run may take")
    p.add_argument("--out", default="runs/serve-check", metavar="DIR",
                   help="writes summary.json, report.md and each vLLM run's request, result and log here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_run)


def _run(a: argparse.Namespace) -> int:
    from polybasic.serving.check import run_serve_check  # start-up time: torch only when it runs

    return run_serve_check(a)
