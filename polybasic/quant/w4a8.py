"""The CPU kernel 'w4a8': 4-bit weight codes x int8 activations (AVX-512 VNNI), built on first use.

kernels/w4a8.cpp holds the arithmetic and the layout (see its header). It is compiled with the C++
compiler torch.compile needs on a CPU anyway (g++, or $CXX), with -march=native, into a cache folder
keyed by the source, torch's version and the CPU's flags ($POLYBASIC_KERNEL_CACHE, default
~/.cache/polybasic/kernels), then loaded as torch.ops.polybasic_w4a8.{mm, vnni}. A fake (meta)
implementation lets torch.compile trace through it. `status()` says once per process whether the fast
path can run here, and why not; quant.linear.W4A8Linear falls back to torch's int4 kernel when it cannot.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from functools import cache
from importlib.resources import files
from pathlib import Path

import torch
from torch import Tensor

GROUP, TILE, BLOCK = 32, 16, 320  # as in kernels/w4a8.cpp: columns per group, rows per tile, bytes per (tile, group)
SOURCE = files("polybasic.quant") / "kernels" / "w4a8.cpp"


def _cpu_flags() -> str:
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernel (once per source, torch version and CPU) and load its ops; returns the
    library's path. Raises RuntimeError naming the cause when no compiler is found or the build fails."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler '{cxx}' on PATH (install g++, which torch.compile needs too, or set CXX)")
    source = SOURCE.read_bytes()
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), _cpu_flags().encode(),
                                     " ".join([cxx, *flags]).encode()])).hexdigest()[:16]
    root = cache_dir or Path(os.environ.get("POLYBASIC_KERNEL_CACHE", Path.home() / ".cache" / "polybasic" / "kernels"))
    lib = root / f"w4a8-{key}.so"
    if not lib.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
        src = lib.with_name(f"w4a8-{key}.cpp")
        src.write_bytes(source)  # the compiler reads a file; the package may be a zip
        cmd = [cxx, *flags, *(f"-I{p}" for p in cpp_extension.include_paths()), str(src),
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building the w4a8 kernel failed ({cxx}):\n{done.stderr[-1500:]}")
        os.replace(tmp, lib)  # atomic: an interrupted or concurrent build never leaves half a library
    if not hasattr(torch.ops.polybasic_w4a8, "mm"):
        torch.ops.load_library(str(lib))
        torch.library.register_fake("polybasic_w4a8::mm")(_mm_fake)
    return lib


def _mm_fake(x: Tensor, packed: Tensor, plain: bool = False) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)  # [M, N]


@cache
def status() -> tuple[bool, str]:
    """(True, '') when the VNNI path runs here; else (False, why): no compiler, a failed build, or a CPU
    without AVX-512 VNNI. Built and decided once per process."""
    try:
        build()
    except RuntimeError as e:
        return False, str(e).splitlines()[0]
    if not torch.ops.polybasic_w4a8.vnni():
        return False, "this CPU has no AVX-512 VNNI"
    return True, ""


def pack(u: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """Codes u [N, K] in [0, 15], scales s and offsets o [N, K/32] (w = s * u + o) -> the kernel's
    tiles [N/16, K/32, 320] uint8: per (tile, group) 256 bytes of codes, 16 fp16 scales, 16 fp16 offsets."""
    n, k = u.shape
    t, g = n // TILE, k // GROUP
    u6 = u.to(torch.uint8).view(t, TILE, g, 2, 4, 4)  # [tile, row, group, half, load, byte]
    codes = (u6[:, :, :, 0] | (u6[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(t, g, 256)
    per_row = [v.to(torch.float16).view(t, TILE, g).transpose(1, 2).contiguous().view(torch.uint8) for v in (s, o)]
    return torch.cat([codes, *per_row], -1).contiguous()  # [t, g, 320]


def mm(x: Tensor, tiles: Tensor) -> Tensor:
    """x [M, K] (any float dtype) times the packed weight -> [M, N] in x's dtype."""
    return torch.ops.polybasic_w4a8.mm(x, tiles)
