"""A W4A8 kernel for CPUs with AVX-512 VNNI against torch's int4 kernel, per M, on a model's layer shapes:

    python -m experiments.w4a8_kernel --tokens 1,2,4,8

What it answers: is the W4 copy's step (int4 codes x bf16, `aten._weight_int4pack_mm_for_cpu`) bound by
memory bandwidth or by the kernel, and would a kernel that multiplies 4-bit codes with 8-bit activations
(vpdpbusd, 64 products an instruction; llama.cpp's way) make the copy's multi-row steps cheaper.
The kernel is polybasic's 'w4a8' (polybasic/quant/kernels/w4a8.cpp: layout and arithmetic in its header;
quant.w4a8 builds it on first use with the C++ compiler torch.compile uses too).

The timed set is one model's linears (default Qwen2.5-Coder-1.5B: 28 layers of q+k+v, o, gate+up and
down, and the LM head), each a different random weight so that every step streams them from memory as
a model's step does; codes are random (the cost does not depend on them). Per M: ms per pass over the
set with each kernel (best of --reps), and the bytes each reads per ms. The first line is the machine's
read ceiling: torch.amax over a 1 GiB uint8 tensor (--ceiling-mib) on the same threads.
"""
from __future__ import annotations

import argparse
import time

import torch

from polybasic.quant import w4a8

GROUP = w4a8.GROUP


def model_shapes(hidden: int, inter: int, kv: int, vocab: int, layers: int) -> list[tuple[int, int]]:
    """(out, in) of a Llama/Qwen-style model's linears, q/k/v and gate/up fused as a W4 copy would run them."""
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]


def shape_args(doc: str, tokens: str) -> argparse.ArgumentParser:
    """The options of a kernel driver: a model's shapes (default Qwen2.5-Coder-1.5B), rows per call, reps."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--inter", type=int, default=8960)
    p.add_argument("--kv", type=int, default=256, help="key (= value) width: kv heads x head size")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--tokens", default=tokens, help="rows M per call")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ceiling-mib", type=int, default=1024, help="size of the read-ceiling probe")
    return p


def main(argv=None) -> None:
    a = shape_args(__doc__, "1,2,4,8").parse_args(argv)
    w4a8.build()
    print(f"threads {torch.get_num_threads()}; AVX-512 VNNI path: {torch.ops.polybasic_w4a8.vnni()}")
    print(read_ceiling(a.ceiling_mib))
    g = torch.Generator().manual_seed(0)
    weights, n4, n8 = [], 0, 0  # bytes a pass reads in torch's layout and in w4a8's
    for n, k in model_shapes(a.hidden, a.inter, a.kv, a.vocab, a.layers):
        u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        s = torch.rand(n, k // GROUP, generator=g) * 0.02
        o = -8 * s
        sz = torch.stack((s, o), -1).transpose(0, 1).contiguous().bfloat16()  # [G, N, 2], torch's layout
        weights.append((k, torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2), sz, w4a8.pack(u, s, o)))
        n4 += n * k // 2 + sz.numel() * 2
        n8 += weights[-1][3].numel()
    print(f"{len(weights)} linears; codes, scales and offsets: {n4 / 1e9:.2f} GB in torch's layout (bf16 scales "
          f"and offsets), {n8 / 1e9:.2f} GB in w4a8's (int8 ones, fp16 factors per 256 columns)\n")
    print("| M | int4pack (aten) ms | GB/s | w4a8 (VNNI) ms | GB/s | int4pack / w4a8 |\n|---|---|---|---|---|---|")
    for m in [int(t) for t in a.tokens.split(",")]:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w[0] for w in weights}}
        runs = {
            "int4pack": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], p4, GROUP, sz) for k, p4, sz, _ in weights],
            "w4a8": lambda: [w4a8.mm(xs[k], pk) for k, _, _, pk in weights]}
        best = {name: [] for name in runs}
        for _ in range(a.reps):  # interleaved: a drift of the machine hits both alike
            for name, f in runs.items():
                best[name].append(_timed(f))
        t4, t8 = min(best["int4pack"]), min(best["w4a8"])
        print(f"| {m} | {t4 * 1e3:.1f} | {n4 / t4 / 1e9:.1f} | {t8 * 1e3:.1f} | {n8 / t8 / 1e9:.1f} | {t4 / t8:.2f}x |")


def read_ceiling(mib: int) -> str:
    """The machine's read ceiling, as a line: torch.amax over `mib` MiB of uint8 on the same threads."""
    big = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)  # written: no shared zero pages
    dt = min(_timed(lambda: torch.amax(big)) for _ in range(3))
    return f"read ceiling: torch.amax of {mib} MiB uint8: {big.numel() / dt / 1e9:.1f} GB/s"


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
