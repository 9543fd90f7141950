"""The row-invariant bf16 kernel against oneDNN's bf16 GEMM per M, on a model's layer shapes:

    python -m experiments.bf16_rows_kernel --tokens 1,2,4,8,12,16,17,32

What it answers: what a bf16 target's one-token step and its verifications of M rows cost on each
kernel, and what bounds each M: the bytes (the weights read once a pass) or the FLOPs. The kernels are
polybasic's 'bf16_rows' (polybasic/models/kernels/bf16_rows.cpp, models.bf16_rows) and torch's
F.linear (oneDNN), which the lean decoder runs with a single row as two (gguf_codes.project) so that
the row's bits match its verification's.

The timed set is one model's linears (default Qwen2.5-Coder-1.5B: 28 layers of q+k+v with their bias,
o, gate+up and down, and the LM head), each a different random bf16 weight so that every pass streams
them from memory as a model's step does. Per M: ms per pass with each kernel (best of --reps,
interleaved), GB/s of weights read and GFLOP/s. The first line is the machine's read ceiling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from experiments.w4a8_kernel import _timed, model_shapes, read_ceiling, shape_args
from polybasic.models import bf16_rows


def main(argv=None) -> None:
    a = shape_args(__doc__, "1,2,4,8,16").parse_args(argv)
    ok, why = bf16_rows.status()
    if not ok:
        raise SystemExit(f"the bf16_rows kernel cannot run here: {why}")
    print(f"threads {torch.get_num_threads()}\n{read_ceiling(a.ceiling_mib)}")
    g = torch.Generator().manual_seed(0)
    shapes = model_shapes(a.hidden, a.inter, a.kv, a.vocab, a.layers)
    weights = [((torch.randn(n, k, generator=g) / k ** 0.5).bfloat16(),
                torch.randn(n, generator=g).bfloat16() if i % 4 == 0 and i < len(shapes) - 1 else None)
               for i, (n, k) in enumerate(shapes)]  # q+k+v carry a bias, as in Qwen
    params = sum(w.numel() for w, _ in weights)
    print(f"{len(weights)} linears, {params / 1e9:.2f}G weights, {2 * params / 1e9:.2f} GB of bf16\n")
    print("| M | oneDNN ms | GB/s | GFLOP/s | bf16_rows ms | GB/s | GFLOP/s | oneDNN / bf16_rows |\n"
          "|---|---|---|---|---|---|---|---|")
    for m in [int(t) for t in a.tokens.split(",")]:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w.shape[1] for w, _ in weights}}
        pad = {k: torch.cat([x, torch.zeros_like(x)]) if m == 1 else x for k, x in xs.items()}  # as project runs it
        runs = {"onednn": lambda: [F.linear(pad[w.shape[1]], w, b) for w, b in weights],
                "bf16_rows": lambda: [bf16_rows.linear(xs[w.shape[1]], w, b) for w, b in weights]}
        best = {name: [] for name in runs}
        for _ in range(a.reps):  # interleaved: a drift of the machine hits both alike
            for name, f in runs.items():
                best[name].append(_timed(f))
        t1, t2 = min(best["onednn"]), min(best["bf16_rows"])
        flops = 2 * m * params
        print(f"| {m} | {t1 * 1e3:.1f} | {2 * params / t1 / 1e9:.1f} | {flops / t1 / 1e9:.0f} | {t2 * 1e3:.1f} | "
              f"{2 * params / t2 / 1e9:.1f} | {flops / t2 / 1e9:.0f} | {t1 / t2:.2f}x |")


if __name__ == "__main__":
    main()
