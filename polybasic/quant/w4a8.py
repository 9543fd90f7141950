"""The CPU kernel 'w4a8': 4-bit (or 6-bit) weight codes x int8 activations (AVX-512 VNNI), built on first use.

kernels/w4a8.cpp holds the arithmetic and the layout (see its header). models.native compiles it for this
CPU on first use (cached), then it is loaded as torch.ops.polybasic_w4a8.{gemm, vnni}. A fake (meta)
implementation lets torch.compile trace through it. `status()` says once per process whether the fast
path can run here, and why not; quant.linear.W4A8Linear falls back to torch's int4 kernel when it cannot.
"""
from __future__ import annotations

from functools import cache
from importlib.resources import files
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from polybasic.models.native import load_ops, usable

# as in kernels/w4a8.cpp: columns per group (4-bit codes), rows per tile, groups per super-block, bytes of a
# (tile, super-block) header; 6-bit codes come in groups of 16, 16 to a super-block
GROUP, TILE, SUPER, HEAD = 32, 16, 8, 64
GROUPS = {4: GROUP, 6: 16}  # code bits -> columns per group
BLOCKS = {4: 288, 6: 224}  # code bits -> bytes of a (tile, group) block: the codes, then 16 s8 and 16 o8
SOURCE = files("polybasic.quant") / "kernels" / "w4a8.cpp"


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernel (once per source, torch version and CPU) and load its ops; returns the
    library's path. Raises RuntimeError naming the cause when no compiler is found or the build fails."""
    return load_ops("w4a8", SOURCE, {"gemm": _mm_fake}, cache_dir)


def _mm_fake(x: Tensor, packed: Tensor, plain: bool = False, bits: int = 4) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * TILE)  # [M, N]


@cache
def status() -> tuple[bool, str]:
    """(True, '') when the VNNI path runs here; else (False, why): no compiler, a failed build, or a CPU
    without AVX-512 VNNI. Built and decided once per process."""
    return usable(build, lambda: torch.ops.polybasic_w4a8.vnni(), "this CPU has no AVX-512 VNNI")


def tile_bytes(k: int, bits: int = 4) -> int:
    """Bytes of one row tile's stream for k input columns of `bits`-bit codes."""
    g, per = k // GROUPS[bits], 256 // GROUPS[bits]
    return -(-g // per) * HEAD + g * BLOCKS[bits]


def factor(v: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group values v [N, G] -> (d [N, ceil(G/8)] fp16, q [N, G] int8) with v ~ d * q per super-block of
    8 groups. d is the super-block's max |v| / 63 where that is exact (scales and mins of llama.cpp's Q4_K
    are 6-bit integers times one fp16 factor per 256 columns, so a copy made from its codes keeps them),
    else / 127: whichever reconstructs the super-block more closely."""
    n, g = v.shape
    nsb = -(-g // SUPER)
    blocks = F.pad(v.float(), (0, nsb * SUPER - g)).view(n, nsb, SUPER)  # [N, nsb, 8]
    amax = blocks.abs().amax(-1)  # [N, nsb]
    best = None
    for top in (63, 127):
        d = (amax / top).half().float()  # [N, nsb], as stored
        q = torch.where(d[..., None] > 0, torch.round(blocks / d[..., None].clamp_min(1e-30)), 0).clamp(-127, 127)
        err = (q * d[..., None] - blocks).abs().amax(-1)  # [N, nsb]
        if best is None:
            best = (d, q, err)
        else:
            take = err < best[2]
            best = (torch.where(take, d, best[0]), torch.where(take[..., None], q, best[1]), None)
    d, q, _ = best
    return d.half(), q.view(n, -1)[:, :g].to(torch.int8)


def effective(v: Tensor) -> Tensor:
    """The per-group values [N, G] fp32 the kernel computes with: factor()'s d * q."""
    d, q = factor(v)
    return d.float().repeat_interleave(SUPER, 1)[:, :q.shape[1]] * q.float()


def pack(u: Tensor, s: Tensor, o: Tensor) -> Tensor:
    """Codes u [N, K] in [0, 15], scales s and offsets o [N, K/32] (w = s * u + o) -> the kernel's
    4-bit tiles [N/16, tile_bytes(K)] uint8, the scales and offsets factored by factor()."""
    return pack_factors(u, *factor(s), *factor(o))


def pack_factors(u: Tensor, ds: Tensor, s8: Tensor, do: Tensor, o8: Tensor, bits: int = 4) -> Tensor:
    """Codes u [N, K] (in [0, 15] for 4 bits, [0, 63] for 6), and w = s * u + o with s = ds * s8, o = do * o8
    per group (32 columns for 4 bits, 16 for 6): ds, do [N, K/256] fp16 per super-block, s8, o8 [N, groups]
    int8 -> the kernel's tiles [N/16, tile_bytes(K, bits)] uint8 (layout in kernels/w4a8.cpp): per row tile,
    super-blocks of a 64-byte header (ds, then do, per row) and BLOCKS[bits] bytes per group (codes, s8, o8)."""
    n, k = u.shape
    t, g, per = n // TILE, k // GROUPS[bits], 256 // GROUPS[bits]
    if bits == 4:
        u6 = u.to(torch.uint8).view(t, TILE, g, 2, 4, 4)  # [tile, row, group, half, load, byte]
        codes = (u6[:, :, :, 0] | (u6[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(t, g, 256)
    else:  # words L = 0..3 (4 columns each) of a row: low nibbles of L and L + 2 share a byte, top 2 bits in a third
        if int(u.max()) > 63:
            raise ValueError(f"6-bit codes must lie in [0, 63], got {int(u.max())}")
        words = u.to(torch.uint8).view(t, TILE, g, 4, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 4, 64)
        low, high = words & 15, words >> 4  # [t, g, word, 64]
        tops = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
        codes = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4), tops], -1)
    per_group = [v.to(torch.int8).view(t, TILE, g).transpose(1, 2).contiguous().view(torch.uint8) for v in (s8, o8)]
    blocks = torch.cat([codes, *per_group], -1)  # [t, g, 288]
    heads = torch.cat([v.half().view(t, TILE, -1).transpose(1, 2).contiguous().view(torch.uint8)
                       for v in (ds, do)], -1)  # [t, nsb, 64]
    parts = []
    for b in range(heads.shape[1]):
        parts += [heads[:, b], blocks[:, b * per:(b + 1) * per].reshape(t, -1)]
    return torch.cat(parts, -1).contiguous()  # [t, tile_bytes(k, bits)]


def mm(x: Tensor, tiles: Tensor, bits: int = 4) -> Tensor:
    """x [M, K] (any float dtype) times the packed weight of `bits`-bit codes -> [M, N] in x's dtype."""
    return torch.ops.polybasic_w4a8.gemm(x, tiles, False, bits)
