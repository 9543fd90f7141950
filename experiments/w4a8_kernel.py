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

With --against REV the kernel's source at git revision REV is built beside this one (as the op namespace
polybasic_w4a8_REV) and timed against it instead of torch's kernel, interleaved, on the same weights (a model's mix of
4-bit and 6-bit tiles as its GGUF has them, --six); each M also checks that both give the same bits.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

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


def kernel_at(rev: str):
    """The w4a8 gemm op as the kernel's source at git revision `rev` builds it (its own namespace)."""
    from polybasic.models.native import load_ops

    name = f"w4a8_{rev}"
    text = subprocess.run(["git", "show", f"{rev}:polybasic/quant/kernels/w4a8.cpp"], capture_output=True, text=True,
                          check=True).stdout
    src = Path(tempfile.mkdtemp()) / f"{name}.cpp"
    src.write_text(text.replace("polybasic_w4a8", f"polybasic_{name}"))
    load_ops(name, src, {"gemm": w4a8._mm_fake})
    return getattr(torch.ops, f"polybasic_{name}").gemm


def main(argv=None) -> None:
    p = shape_args(__doc__, "1,2,4,8")
    p.add_argument("--against", metavar="REV", help="time the kernel's source at this git revision instead of torch's")
    p.add_argument("--six", default="lm_head,down:odd", help="with --against: the linears on 6-bit tiles (the LM head, "
                   "every other layer's down projection: Qwen2.5-Coder-1.5B's Q4_K_M)")
    a = p.parse_args(argv)
    w4a8.build()
    if a.against:
        return against(a)
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


def against(a) -> None:
    """--against REV: REV's kernel and this one on one model's linears, per M (interleaved, best of --reps)."""
    old, new = kernel_at(a.against), torch.ops.polybasic_w4a8.gemm
    print(f"threads {torch.get_num_threads()}; {read_ceiling(a.ceiling_mib)}")
    g = torch.Generator().manual_seed(0)
    weights = []  # (K, bits, tiles)
    for i, (n, k) in enumerate(model_shapes(a.hidden, a.inter, a.kv, a.vocab, a.layers)):
        lm_head, down_odd = i == 4 * a.layers, i % 8 == 7
        bits = 6 if (lm_head and "lm_head" in a.six) or (down_odd and "down:odd" in a.six) else 4
        group, nsb = w4a8.GROUPS[bits], -(-k // 256)
        u = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
        ds, do = (torch.rand(n, nsb, generator=g) * 1e-3).half(), (-torch.rand(n, nsb, generator=g) * 1e-3).half()
        s8, o8 = (torch.randint(-128, 128, (n, k // group), generator=g, dtype=torch.int8) for _ in range(2))
        weights.append((k, bits, w4a8.pack_factors(u, ds, s8, do, o8, bits)))
    gb = sum(w[2].numel() for w in weights) / 1e9
    print(f"{len(weights)} linears ({sum(w[1] == 6 for w in weights)} on 6-bit tiles), {gb:.2f} GB of tiles\n")
    print(f"| M | {a.against} ms | now ms | {a.against} / now | same bits |\n|---|---|---|---|---|")
    for m in [int(t) for t in a.tokens.split(",")]:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w[0] for w in weights}}
        same = all(torch.equal(old(xs[k], t, False, b), new(xs[k], t, False, b)) for k, b, t in weights)
        best = {old: [], new: []}
        for _ in range(a.reps):
            for op in best:
                best[op].append(_timed(lambda: [op(xs[k], t, False, b) for k, b, t in weights]))
        to, tn = min(best[old]), min(best[new])
        print(f"| {m} | {to * 1e3:.1f} | {tn * 1e3:.1f} | {to / tn:.2f}x | {same} |", flush=True)


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
