"""One-token steps that read a GGUF model's block codes instead of its expanded fp32 weights.

A GGUF file stores most weights as blocks of 32 codes with an f16 scale (and for Q4_1 an f16
minimum). Loading expands every weight to fp32 (as transformers does): each value is
`scale * code (+ minimum)` rounded once to fp32. A one-token step is bound by reading weights, so
it can keep 1 byte per weight (the code) plus the fp32 scale/minimum per block and expand each
weight in registers to the *same* fp32 value; products and sums stay fp32. Only the order of
the fp32 sums differs from a BLAS GEMV (as with any fused kernel).

`attach_codes` finds each GGUF tensor's rows inside the model's (fused) linears by content and
attaches the codes only where expanding them reproduces the model's fp32 weight bit for bit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

BLOCK = 32  # values per block in Q4_0, Q4_1, Q8_0


@dataclass
class BlockCodes:
    """One 2-D GGUF tensor: N rows of K values in K/32 blocks."""
    codes: Tensor  # [N, K/32, 32] uint8 (Q4_1) or int8 (Q4_0 minus 8, Q8_0)
    scale: Tensor  # [N, K/32, 1] fp32
    minimum: Tensor | None  # [N, K/32, 1] fp32 (Q4_1), else None

    def dequantize(self) -> Tensor:
        """[N, K] fp32, the values gguf (and so transformers) expands the tensor to."""
        return expand(self.codes, self.scale, self.minimum).flatten(1)


def expand(codes: Tensor, scale: Tensor, minimum: Tensor | None) -> Tensor:
    """[N, K/32, 32] fp32 weights: `scale * code (+ minimum)`, one fp32 rounding, as gguf does."""
    w = codes.float() * scale
    return w if minimum is None else w + minimum


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _parse(kind: str, raw: np.ndarray, n: int, k: int) -> BlockCodes:
    """raw [n * k/32, block bytes] uint8 -> codes, following gguf-py's dequantize for `kind`."""
    scale = raw[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    minimum = None
    if kind == "Q4_1":
        minimum = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        codes = _nibbles(raw[:, 4:])
    elif kind == "Q4_0":
        codes = _nibbles(raw[:, 2:]).astype(np.int8) - 8
    else:  # Q8_0
        codes = raw[:, 2:].copy().view(np.int8)
    g = k // BLOCK
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).view(n, g, -1)  # noqa: E731
    return BlockCodes(as_t(codes), as_t(scale), None if minimum is None else as_t(minimum))


def read_codes(path: str | Path) -> list[BlockCodes]:
    """Every 2-D Q4_0 / Q4_1 / Q8_0 tensor of a GGUF file."""
    from gguf import GGUFReader

    out = []
    for t in GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind not in ("Q4_0", "Q4_1", "Q8_0") or len(t.shape) != 2:
            continue
        k, n = (int(s) for s in t.shape)  # GGUF lists the contiguous dim first
        raw = np.asarray(t.data, dtype=np.uint8).reshape(n * (k // BLOCK), -1)
        out.append(_parse(kind, raw, n, k))
    return out


def coded_matvec(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor | None) -> Tensor:
    """x [B, 1, K] fp32 times the expanded weight [N, K] transposed -> [B, 1, N].

    Written as multiply-and-sum (not a matmul) so inductor fuses the expansion into one reduction
    that reads 1 byte per weight.
    """
    w = expand(codes, scale, minimum)  # [N, K/32, 32]
    b = x.shape[0]
    return (w * x.reshape(b, 1, *codes.shape[1:])).sum((-1, -2)).unsqueeze(1)  # [B, 1, N]


def _row_keys(w: Tensor) -> list[int]:
    a = w.detach().contiguous().numpy()
    return [hash(row.tobytes()) for row in a]


def attach_codes(model: nn.Module, path: str | Path) -> int:
    """Give the model's fp32 linears `codes`, `code_scale`, `code_min` buffers from a GGUF file.

    A linear gets them only if every one of its rows is found among the file's tensors and the
    expanded codes equal its weight exactly. Returns how many linears got codes.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu" and m.in_features % BLOCK == 0]
    if not linears:
        return 0
    tensors = read_codes(path)
    where: dict[int, tuple[int, int]] = {}  # hash of an fp32 row -> (tensor, row)
    for ti, t in enumerate(tensors):
        for ri, key in enumerate(_row_keys(t.dequantize())):
            where.setdefault(key, (ti, ri))
    done = 0
    for lin in linears:
        hits = [where.get(key) for key in _row_keys(lin.weight)]
        if None in hits:
            continue
        layouts = {(tensors[t].codes.dtype, tensors[t].codes.shape[1:], tensors[t].minimum is None)
                   for t, _ in hits}
        if len(layouts) != 1:  # rows from tensors of different block formats: keep the fp32 weight
            continue
        pick = lambda field: torch.stack([getattr(tensors[t], field)[r] for t, r in hits])  # noqa: E731
        minimum = None if layouts.pop()[2] else pick("minimum")
        codes, scale = pick("codes"), pick("scale")
        if not torch.equal(BlockCodes(codes, scale, minimum).dequantize(), lin.weight):
            continue
        lin.register_buffer("codes", codes, persistent=False)
        lin.register_buffer("code_scale", scale, persistent=False)
        lin.register_buffer("code_min", minimum, persistent=False)
        done += 1
    log.info("GGUF block codes attached to %d of %d linears", done, len(linears))
    return done


def _realized(x: Tensor) -> Tensor:
    """x [..., K] (K even), unchanged, but stored before a coded matvec reads it.

    Inductor inlines a pointwise producer (an RMSNorm, silu * up) into the consuming reduction,
    which recomputes it for every output row: 26-32 ms per SmolLM2 step instead of 14.5. It has no
    complex kernels, so this round trip through a complex view falls back to aten views, whose
    input it must store first.
    """
    return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))).reshape(x.shape)


def project(lin: nn.Module, x: Tensor) -> Tensor:
    """lin(x), except that a one-token step under torch.compile reads the block codes (if attached)."""
    codes = getattr(lin, "codes", None)
    if codes is not None and x.shape[-2] == 1 and x.dim() == 3 and torch.compiler.is_compiling():
        return coded_matvec(_realized(x), codes, lin.code_scale, lin.code_min)
    return lin(x)
