"""A W4A8 kernel for CPUs with AVX-512 VNNI against torch's int4 kernel, per M, on a model's layer shapes:

    python -m experiments.w4a8_kernel --tokens 1,2,4,8

What it answers: is the W4 copy's step (int4 codes x bf16, `aten._weight_int4pack_mm_for_cpu`) bound by
memory bandwidth or by the kernel, and would a kernel that multiplies 4-bit codes with 8-bit activations
(vpdpbusd, 64 products an instruction; llama.cpp's way) make the copy's multi-row steps cheaper.
experiments/w4a8/kernel.cpp is the kernel (layout and arithmetic in its header); it is built here with
the C++ compiler torch.compile uses too (-O3 -march=native -fopenmp), cached per source, torch and CPU.

The timed set is one model's linears (default Qwen2.5-Coder-1.5B: 28 layers of q+k+v, o, gate+up and
down, and the LM head), each a different random weight so that every step streams them from memory as
a model's step does; codes are random (the cost does not depend on them). Per M: ms per pass over the
set with each kernel (best of --reps), and the bytes each reads per ms. The first line is the machine's
read ceiling: torch.amax over a 1 GiB uint8 tensor (--ceiling-mib) on the same threads.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("w4a8") / "kernel.cpp"
GROUP, TILE, BLOCK = 32, 16, 320  # as in kernel.cpp


def cpu_flags() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def build(cache: Path | None = None) -> Path:
    """Compile kernel.cpp into a shared library (once per source, torch version and CPU) and load its ops
    (torch.ops.polybasic_w4a8). Returns the library's path."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler '{cxx}' on PATH; install g++ (torch.compile on a CPU needs it too) or set CXX")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + cpu_flags().encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    cache = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "polybasic" / "w4a8"
    lib = cache / key / "kernel.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, *flags, *(f"-I{p}" for p in cpp_extension.include_paths()), str(SOURCE),
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, lib)  # atomic: a concurrent or interrupted build never leaves half a library
    if not hasattr(torch.ops.polybasic_w4a8, "mm"):
        torch.ops.load_library(str(lib))
    return lib


def pack(u: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Codes u [N, K] in [0, 15], scales s and offsets o [N, K/32] (w = s * u + o) -> [N/16, K/32, 320] uint8."""
    n, k = u.shape
    t, g = n // TILE, k // GROUP
    u6 = u.to(torch.uint8).view(t, TILE, g, 2, 4, 4)  # [tile, row, group, half, load, byte]
    codes = (u6[:, :, :, 0] | (u6[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(t, g, 256)
    per_row = [v.half().view(t, TILE, g).transpose(1, 2).contiguous().view(torch.uint8) for v in (s, o)]  # [t, g, 32]
    return torch.cat([codes, *per_row], -1).contiguous()  # [t, g, 320]


def reference(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in float64: (y [M, N], the sum of the magnitudes of its terms [M, N])."""
    m, k = x.shape
    xg = x.float().view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1, keepdim=True)
    xq = torch.where(amax > 0, torch.round(xg * (127 / amax)), torch.zeros_like(xg)).double()
    a, xsum = (amax[..., 0] / 127).double(), xg.sum(-1).double()  # [M, G]
    dots = torch.einsum("mgk,ngk->mng", xq, u.double().view(u.shape[0], -1, GROUP))  # [M, N, G]
    s16, o16 = s.half().double()[None], o.half().double()[None]
    terms = dots * s16 * a[:, None] + o16 * xsum[:, None]
    mags = (dots * s16 * a[:, None]).abs() + (o16 * xsum[:, None]).abs()
    return terms.sum(-1), mags.sum(-1)


def model_shapes(hidden: int, inter: int, kv: int, vocab: int, layers: int) -> list[tuple[int, int]]:
    """(out, in) of a Llama/Qwen-style model's linears, q/k/v and gate/up fused as a W4 copy would run them."""
    return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--inter", type=int, default=8960)
    p.add_argument("--kv", type=int, default=256, help="key (= value) width: kv heads x head size")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--tokens", default="1,2,4,8", help="rows M per call")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ceiling-mib", type=int, default=1024, help="size of the read-ceiling probe")
    a = p.parse_args(argv)
    build()
    print(f"threads {torch.get_num_threads()}; AVX-512 VNNI path: {torch.ops.polybasic_w4a8.vnni()}")
    big = torch.randint(0, 255, (a.ceiling_mib << 20,), dtype=torch.uint8)  # written: no shared zero pages
    dt = min(_timed(lambda: torch.amax(big)) for _ in range(3))
    print(f"read ceiling: torch.amax of {a.ceiling_mib} MiB uint8: {big.numel() / dt / 1e9:.1f} GB/s")
    del big
    g = torch.Generator().manual_seed(0)
    weights, nbytes = [], 0
    for n, k in model_shapes(a.hidden, a.inter, a.kv, a.vocab, a.layers):
        u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        s = torch.rand(n, k // GROUP, generator=g) * 0.02
        o = -8 * s
        sz = torch.stack((s, o), -1).transpose(0, 1).contiguous().bfloat16()  # [G, N, 2], torch's layout
        weights.append((k, torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2), sz, pack(u, s, o)))
        nbytes += n * k // 2 + sz.numel() * 2
    print(f"{len(weights)} linears, {nbytes / 1e9:.2f} GB of codes, scales and offsets in either layout\n")
    print("| M | int4pack (aten) ms | GB/s | w4a8 (VNNI) ms | GB/s | int4pack / w4a8 |\n|---|---|---|---|---|---|")
    for m in [int(t) for t in a.tokens.split(",")]:
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for k in {w[0] for w in weights}}
        runs = {
            "int4pack": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], p4, GROUP, sz) for k, p4, sz, _ in weights],
            "w4a8": lambda: [torch.ops.polybasic_w4a8.mm(xs[k], pk) for k, _, _, pk in weights]}
        best = {name: [] for name in runs}
        for _ in range(a.reps):  # interleaved: a drift of the machine hits both alike
            for name, f in runs.items():
                best[name].append(_timed(f))
        t4, t8 = min(best["int4pack"]), min(best["w4a8"])
        print(f"| {m} | {t4 * 1e3:.1f} | {nbytes / t4 / 1e9:.1f} | {t8 * 1e3:.1f} | {nbytes / t8 / 1e9:.1f} | {t4 / t8:.2f}x |")


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
