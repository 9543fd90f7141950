"""Serving engines beside our runtime: `polybasic serve-check` runs vLLM on a bundle's top link (the
target and the EAGLE-3 head right under it, exported in the speculators format) and compares it with
our runtime on the same Spec-Bench prompts, token for token.

  vllm_run.py  vLLM's side: a worker run by the vLLM virtual environment's python (`make vllm-check`
               makes `.venv-vllm`); it reads prompt token ids from a JSON request and writes tokens,
               timings and vLLM's spec-decode counters. It imports vllm and the standard library only.
  compare.py   pure functions (no torch): identity, first difference, acceptance, the JSON summary and
               the markdown report.
  check.py     the whole check in our virtual environment: the bundle's parts, our runtime's side (greedy
               tokens, tau, tokens/s), the two vLLM runs as subprocesses, the near-tie gaps.

Layer: between pipelines and bench (pipelines > serving > bench): it runs bench's methods for our
side, and a recipe stage could run it in turn.
"""
