"""Build and load polybasic's C++ CPU kernels (models/kernels/*.cpp, quant/kernels/*.cpp) on first use.

Each source is compiled with the C++ compiler torch.compile needs on a CPU anyway (g++, or $CXX), with
-march=native ($POLYBASIC_KERNEL_MARCH names another target, e.g. x86-64-v3 for a build without AVX-512, which
takes the kernels' portable paths), into a cache folder keyed by the source, torch's version, the CPU's flags and
the command ($POLYBASIC_KERNEL_CACHE, default ~/.cache/polybasic/kernels), then loaded into torch.ops. Builds are
atomic: an interrupted or concurrent build never leaves half a library.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.resources.abc import Traversable
from pathlib import Path

import torch

from polybasic.artifacts import write_text


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ('' where there is none)."""
    try:
        return next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return ""


def cache_root() -> Path:
    return Path(os.environ.get("POLYBASIC_KERNEL_CACHE", Path.home() / ".cache" / "polybasic" / "kernels"))


MARCH_ENV = "POLYBASIC_KERNEL_MARCH"


def march() -> str:
    """The -march the kernels are built for: $POLYBASIC_KERNEL_MARCH, default native (this CPU)."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def build_library(name: str, source: Traversable, cache_dir: Path | None = None) -> Path:
    """Compile `source` (once per source, torch version and CPU) into `name`-KEY.so and return its path
    (not loaded: torch.ops.load_library it once). Raises RuntimeError naming the cause when no compiler is
    found or the build fails."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler '{cxx}' on PATH (install g++, which torch.compile needs too, or set CXX)")
    text = source.read_bytes()
    flags = ["-O3", f"-march={march()}", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    key = hashlib.sha256(b"\0".join([text, torch.__version__.encode(), cpu_flags().encode(),
                                     " ".join([cxx, *flags]).encode()])).hexdigest()[:16]
    root = cache_dir or cache_root()
    lib = root / f"{name}-{key}.so"
    if not lib.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f"{lib.name}.{os.getpid()}.tmp")
        src = lib.with_name(f"{name}-{key}.cpp")
        src.write_bytes(text)  # the compiler reads a file; the package may be a zip
        cmd = [cxx, *flags, *(f"-I{p}" for p in cpp_extension.include_paths()), str(src),
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building the {name} kernel failed ({cxx}):\n{done.stderr[-1500:]}")
        os.replace(tmp, lib)
    return lib


def load_ops(name: str, source: Traversable, fakes: dict[str, Callable], cache_dir: Path | None = None) -> Path:
    """build_library, then load it once as torch.ops.polybasic_`name`, with a fake (meta) implementation per
    op (`fakes`: op name -> function) so that torch.compile traces through them; returns the library's path.
    The library's key joins torch.compile's cache key (tag_compile_caches)."""
    lib = build_library(name, source, cache_dir)
    ops = getattr(torch.ops, f"polybasic_{name}")
    if not all(hasattr(ops, op) for op in fakes):
        torch.ops.load_library(str(lib))
        for op, fake in fakes.items():
            torch.library.register_fake(f"polybasic_{name}::{op}")(fake)
    tag_compile_caches(lib.stem)
    return lib


def tag_compile_caches(library: str) -> None:
    """Add `library` (NAME-KEY, the key of its source) to torch.compiler.config.cache_key_tag, so that graphs
    inductor cached on disk are reused only with the kernels they were compiled against: its cache key covers a
    graph and torch but not a custom op's schema, and a graph compiled against an older schema (one argument
    fewer) read past its argument list: a segfault. The tag lists the libraries sorted, after any tag of the
    user's."""
    config = torch.compiler.config
    parts = [p for p in config.cache_key_tag.split("|") if p]
    mine = {p for p in parts if p.startswith("polybasic_")}
    if f"polybasic_{library}" not in mine:
        rest = [p for p in parts if p not in mine]
        config.cache_key_tag = "|".join(rest + sorted(mine | {f"polybasic_{library}"}))


def trust_probed_vec_isa(cache_dir: Path | None = None) -> bool:
    """Let inductor skip its probes of the CPU's vector ISAs where they have all passed before; returns whether it will.

    Before its first CPU compile, every process builds a test library for each ISA the CPU's flags name and loads it
    in a child Python (~0.15 s apiece; ~0.9 s of each process's first call on an AVX-512 CPU). A marker file in the
    kernel cache, keyed by torch's version, the Python, the compiler binary and the CPU's flags, records that every
    probe passed here; a process that finds it sets inductor's config.cpp.vec_isa_ok instead of probing, which picks
    the same ISA (the best the flags name). Where a probe fails, no marker is written and every process probes, as
    without this. A vec_isa_ok the user set is left as it is."""
    from torch._inductor import config  # start-up time: only a compiling process imports inductor

    ok = getattr(config.cpp, "vec_isa_ok", False)  # False where another torch has no such setting
    if ok is not None:
        return bool(ok)
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    cxx = shutil.which(os.environ.get("CXX", "g++")) or ""
    stat = os.stat(cxx) if cxx else None
    key = hashlib.sha256("\0".join([torch.__version__, sys.executable, cxx, str(stat and stat.st_size),
                                    str(stat and stat.st_mtime_ns), cpu_flags()]).encode()).hexdigest()[:16]
    marker = (cache_dir or cache_root()) / f"vec-isa-{key}.ok"
    if not marker.is_file():
        try:
            if not _every_vec_isa_probe_passes():
                return False
        except AttributeError:  # another torch's internals: leave inductor to probe, as without this
            return False
        try:
            write_text(marker, "inductor's vector ISA probes all passed with this torch, compiler and CPU\n")
        except OSError:  # a read-only cache: this process has probed already, the next one probes again
            pass
    config.cpp.vec_isa_ok = True
    return True


def _every_vec_isa_probe_passes() -> bool:
    """Whether inductor's probes accept every vector ISA the CPU's flags name (running them, as its first compile
    would)."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    named = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == [str(isa) for isa in named]


def usable(build: Callable[[], object], native: Callable[[], bool], missing: str) -> tuple[bool, str]:
    """(True, '') when `build()` succeeds and `native()` says the fast path was compiled for this CPU; else
    (False, why): the build's first error line, or `missing` (the CPU feature it lacks)."""
    try:
        build()
    except RuntimeError as e:
        return False, str(e).splitlines()[0]
    return (True, "") if native() else (False, missing)
