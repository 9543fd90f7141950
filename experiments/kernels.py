"""Which kernel runs a target's verification fastest: T(M) of one model in several numerics.

    python -m experiments.kernels --model qwen2.5-coder-1.5b --tokens 1,2,4,6,8,12,16 \
        --kernels bfloat16,bfloat16-compiled,float32,float32-compiled,runs/qwen2.5-coder-1.5b-cpu/model.safetensors

Each kernel is the target loaded in a dtype (`bfloat16`, `float32`, ...), `DTYPE-compiled` (the same
model with every forward run as compiled static-shape steps, models.static: M padded up to the next
step size; in fp32 one-token steps read the GGUF's block codes, M >= 2 runs the dense DTYPE GEMMs), or
a quantized copy (`PATH.safetensors`, e.g. int4 x bf16: another model's numerics, listed for its
cost; `PATH.safetensors-compiled` compiled alike). The first call of each step size (its compile)
falls in the warm-up. Times are what a chain's verification calls (ModelLevel.score: forward and the
distributions of M rows, planner.measure.cost_curve) at a prefilled context, medians of --reps.
Models are loaded one at a time, so the peak memory is the largest one's. Prints a markdown table
(ms per forward, the fastest per M in bold) and writes it with the raw curves to --json.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time


def _load(kernel: str, model: str):
    from polybasic.models.prepare import compile_for_device
    from polybasic.quant.api import load_any_model

    base, compiled = (kernel[:-len("-compiled")], True) if kernel.endswith("-compiled") else (kernel, False)
    if base.endswith(".safetensors"):
        m = load_any_model(base).model
        if compiled:
            compile_for_device(m, flag=f"--kernels {kernel}")
        return m
    dtype, _, mode = kernel.partition("-")
    if mode not in ("", "compiled"):
        from polybasic.errors import ConfigError

        raise ConfigError(f"--kernels: {kernel!r}: after the dtype only '-compiled' is known; e.g. float32-compiled")
    lm = load_any_model(model, dtype)
    if mode:
        compile_for_device(lm.model, lm.gguf_file, flag=f"--kernels {kernel}")
    return lm.model


def measure(model: str, kernels: list[str], tokens: list[int], context: int, reps: int) -> dict[str, dict]:
    """{kernel: {"tokens", "ms", "step_ms", "prefill_ms", "load_s"}} of each kernel in turn."""
    from polybasic.planner.measure import cost_curve

    out = {}
    for kernel in kernels:
        t0 = time.perf_counter()
        m = _load(kernel, model)
        load_s = time.perf_counter() - t0
        c = cost_curve(m, tokens, context, reps, warmup=1)
        out[kernel] = {"tokens": list(c.tokens), "ms": [round(x, 1) for x in c.time_ms],
                       "step_ms": round(c.decode_ms, 1), "prefill_ms": round(c.prefill_ms, 1),
                       "load_s": round(load_s, 1)}
        print(f"{kernel}: step {c.decode_ms:.1f} ms, " + ", ".join(
            f"M={t}: {x:.1f}" for t, x in zip(c.tokens, c.time_ms)), file=sys.stderr, flush=True)
        del m
        gc.collect()
    return out


def render(curves: dict[str, dict], context: int) -> str:
    tokens = next(iter(curves.values()))["tokens"]
    best = {t: min(c["ms"][i] for c in curves.values()) for i, t in enumerate(tokens)}
    lines = [f"ms per forward of M tokens at a context of {context} (verification as a chain runs it); "
             "`step` is vanilla's one-token step", "",
             "| kernel | step | " + " | ".join(f"M={t}" for t in tokens) + f" | prefill {context} |",
             "|---|---|" + "---|" * (len(tokens) + 1)]
    for name, c in curves.items():
        cells = [f"**{x}**" if x == best[t] else f"{x}" for t, x in zip(tokens, c["ms"])]
        lines.append(f"| {name} | {c['step_ms']} | " + " | ".join(cells) + f" | {c['prefill_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from polybasic.errors import PolybasicError

    p = argparse.ArgumentParser(prog="python -m experiments.kernels", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target (any source --model accepts)")
    p.add_argument("--kernels", default="bfloat16,bfloat16-compiled,float32,float32-compiled",
                   help="comma-separated: DTYPE, DTYPE-compiled or a quantized PATH.safetensors")
    p.add_argument("--tokens", default="1,2,4,6,8,12,16", help="comma-separated M (tokens per forward)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="write the curves and the table here")
    a = p.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens: expected comma-separated ints, got {a.tokens!r}")
    kernels = [k for k in a.kernels.split(",") if k]
    if not kernels:
        p.error("--kernels: name at least one kernel, e.g. bfloat16")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        curves = measure(a.model, kernels, tokens, a.context, a.reps)
    except PolybasicError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = render(curves, a.context)
    print(f"$ python -m experiments.kernels {' '.join(argv if argv is not None else sys.argv[1:])}\n")
    print(table)
    if a.json:
        from polybasic.artifacts import write_json

        write_json(a.json, {"model": a.model, "context": a.context, "curves": curves, "table": table}, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
