"""Compiled steps (of up to CODED_ROWS tokens) that read a GGUF model's block codes instead of its
expanded fp32 weights.

A GGUF file stores most weights as blocks of codes sharing an f16 scale: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0
blocks of 32 (Q4_1/Q5_1 with an f16 minimum), and k-quant super-blocks of 256 whose sub-block
scales are themselves quantized (Q4_K/Q5_K: 8 sub-blocks of 32 with 6-bit scales and minimums under
f16 d and dmin; Q6_K: 16 sub-blocks of 16 with int8 scales under an f16 d). Loading expands every
weight to fp32 (as transformers does): each value is `scale * code (+ minimum)` rounded once to
fp32, where the k-quant effective scales d*sc and minimums -dmin*m are exact in fp32 and expanded
once here, per group of 32 or 16, so one form serves every type. A one-token step is bound by
reading weights, so it can keep 1 byte per weight (the code) plus the fp32 scale/minimum per group
and expand each weight in registers to the *same* fp32 value; products and sums stay fp32. Only
the order of the fp32 sums differs from a BLAS GEMV (as with any fused kernel).

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

from polybasic.models import bf16_rows
from polybasic.models.gguf_index import read_tensor_infos

log = logging.getLogger(__name__)

BLOCK = 32  # values per block in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (and per sub-block in Q4_K, Q5_K)


@dataclass
class BlockCodes:
    """One 2-D GGUF tensor: N rows of K values in groups of g (32, or 16 for Q6_K) sharing a scale."""
    codes: Tensor  # [N, K/g, g] uint8 (Q4_1, Q5_1, Q4_K, Q5_K) or int8 (Q4_0, Q5_0, Q8_0, Q6_K: signed)
    scale: Tensor  # [N, K/g, 1] fp32
    minimum: Tensor | None  # [N, K/g, 1] fp32 added after the product (Q4_K, Q5_K: -dmin*m), else None
    kind: str = ""  # the GGUF block type, e.g. "Q4_K"

    def dequantize(self) -> Tensor:
        """[N, K] fp32, the values gguf (and so transformers) expands the tensor to."""
        return expand(self.codes, self.scale, self.minimum).flatten(1)


def expand(codes: Tensor, scale: Tensor, minimum: Tensor | None) -> Tensor:
    """[N, K/g, g] fp32 weights: `scale * code (+ minimum)`, one fp32 rounding, as gguf does.

    Every scale is exact in fp32 (an f16 times a <= 8-bit integer), so gguf's k-quant formulas
    (d*sc) * q - dmin*m reduce to this form bit for bit (x - y == x + (-y) in IEEE arithmetic).
    """
    w = codes.float() * scale
    return w if minimum is None else w + minimum


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] fp32."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] codes: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32] fifth bits, bit i for value i (Q5_0, Q5_1)."""
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)  # [n, 32]
    return (bits & 1).astype(np.uint8) << 4


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 8, 32]: sub-block 2j is the low nibbles of bytes 32j.., 2j+1 the high."""
    n = qs.shape[0]
    return ((qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F).reshape(n, 8, 32)


def k_factors(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-blocks [n, bytes] -> d, dmin [n, 1] fp32 (from f16) and the 6-bit sc, m [n, 8] uint8
    of its 8 sub-blocks: value = d * sc * code - dmin * m."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(raw[:, 4:16])  # [n, 8] 6-bit each
    return _f16(raw[:, 0:2]), _f16(raw[:, 2:4]), sc, m


def q4k_codes(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [n, 144] -> their codes [n, 8, 32] uint8 in [0, 15] (sub-blocks of 32)."""
    return _k_nibbles(raw[:, 16:144])


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-block header -> (scale, minimum) [n, 8, 1] fp32 of its 8 sub-blocks."""
    d, dmin, sc, m = k_factors(raw)
    return (d * sc.astype(np.float32))[..., None], -(dmin * m.astype(np.float32))[..., None]


def q6k_factors(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks [n, 210] (128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d) ->
    codes [n, 16, 16] uint8 in [0, 63], d [n, 1] fp32 and sc [n, 16] int8: value = d * sc * (code - 32)."""
    n = raw.shape[0]
    ql = (raw[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0x0F
    qh = (raw[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q = ql.reshape(n, 8, 32) | (qh.reshape(n, 8, 32) << 4)
    return q.reshape(n, 16, 16), _f16(raw[:, 208:210]), raw[:, 192:208].copy().view(np.int8)


def _blocks(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """raw [blocks, bytes] -> codes [blocks, S, g], scale and minimum [blocks, S, 1], following
    gguf-py's dequantize for `kind` (S groups of g values per block)."""
    n = raw.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        scale, minimum = _f16(raw[:, :2]), None
        body = raw[:, 2:]
        if kind in ("Q4_1", "Q5_1"):
            minimum, body = _f16(raw[:, 2:4]), raw[:, 4:]
        if kind == "Q8_0":
            codes = body.copy().view(np.int8)
        elif kind.startswith("Q4"):
            codes = _nibbles(body)
        else:
            codes = _nibbles(body[:, 4:]) | _high_bits(body[:, :4])
        if kind == "Q4_0":
            codes = codes.astype(np.int8) - 8
        elif kind == "Q5_0":
            codes = codes.astype(np.int8) - 16
        expand_dims = lambda a: None if a is None else a[:, None]  # noqa: E731  [blocks, 1, 1]
        return codes[:, None], expand_dims(scale), expand_dims(minimum)
    if kind == "Q4_K":  # d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        scale, minimum = _k_scales(raw)
        return q4k_codes(raw), scale, minimum
    if kind == "Q5_K":  # ... then 32 bytes of fifth bits (bit j of byte i: value i of sub-block j)
        scale, minimum = _k_scales(raw)
        qh = (raw[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, 8, 32]
        return _k_nibbles(raw[:, 48:176]) | (qh << 4), scale, minimum
    if kind == "Q6_K":
        q, d, sc = q6k_factors(raw)
        return q.astype(np.int8) - 32, (d * sc.astype(np.float32))[..., None], None  # [n, 16, 16], [n, 16, 1]
    raise ValueError(f"GGUF block type {kind} has no code reader")


BLOCK_QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # what read_codes reads


def _parse(kind: str, raw: np.ndarray, n: int, k: int) -> BlockCodes:
    """raw [blocks, block bytes] uint8 of an [n, k] tensor -> its BlockCodes."""
    codes, scale, minimum = _blocks(kind, raw)
    g = codes.shape[-1]
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).view(n, k // g, -1)  # noqa: E731
    return BlockCodes(as_t(codes), as_t(scale), None if minimum is None else as_t(minimum), kind)


def read_codes(path: str | Path) -> list[BlockCodes]:
    """Every 2-D tensor of a GGUF file in one of BLOCK_QUANT_TYPES (F16/F32 and others keep their fp32 weights)."""
    out = []
    for t in read_tensor_infos(path):
        if t.kind not in BLOCK_QUANT_TYPES or len(t.shape) != 2:
            continue
        k, n = t.shape  # GGUF lists the contiguous dim first
        out.append(_parse(t.kind, t.data.reshape(-1, t.block_bytes), n, k))
    return out


def coded_matvec(x: Tensor, codes: Tensor, scale: Tensor, minimum: Tensor | None) -> Tensor:
    """x [B, M, K] fp32 times the expanded weight [N, K] transposed -> [B, M, N].

    Written as multiply-and-sum (not a matmul) so inductor fuses the expansion into one reduction
    that reads 1 byte per weight. For M > 1 rows the output is produced transposed, [N, B*M], so the
    fused loop runs over weight rows outside and token rows inside: each weight row is read from
    memory once and reused from cache for every token row.
    """
    w = expand(codes, scale, minimum)  # [N, K/32, 32]
    b, m = x.shape[0], x.shape[1]
    if m == 1:
        return (w * x.reshape(b, 1, *codes.shape[1:])).sum((-1, -2)).unsqueeze(1)  # [B, 1, N]
    y = (w.unsqueeze(1) * x.reshape(1, b * m, *codes.shape[1:])).sum((-1, -2))  # [N, B*M]
    return y.t().reshape(b, m, -1)


def _row_keys(w: Tensor, sample: bool = False) -> list[int]:
    """A hash per row of w [N, K]: of all its values, or with `sample` of its first and last BLOCK values
    only (cheap; equal keys then name candidate rows, which the caller must check whole)."""
    if sample:
        w = torch.cat([w[:, :BLOCK], w[:, -BLOCK:]], 1)
    a = w.detach().contiguous().numpy()
    return [hash(row.tobytes()) for row in a]


def _sampled(t: BlockCodes) -> Tensor:
    """[N, 2 * BLOCK] fp32: the expanded first and last BLOCK values of every row of t (_row_keys' sample)."""
    n = max(1, BLOCK // t.codes.shape[-1])  # groups per BLOCK values
    ends = [slice(0, n), slice(-n, None)]
    mins = [None if t.minimum is None else t.minimum[:, e] for e in ends]
    return torch.cat([expand(t.codes[:, e], t.scale[:, e], m).flatten(1) for e, m in zip(ends, mins)], 1)


def rows_by_tensor(hits: list[tuple[int, int] | None]) -> dict[int, tuple[list[int], list[int]]]:
    """hits [(tensor, row) or None per row i] -> {tensor: (the rows i it holds, their rows there)}."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for i, hit in enumerate(hits):
        if hit is not None:
            mine, theirs = out.setdefault(hit[0], ([], []))
            mine.append(i)
            theirs.append(hit[1])
    return out


def _stack_rows(tensors: list[BlockCodes], hits: list[tuple[int, int]]) -> tuple[Tensor, Tensor, Tensor | None]:
    """Row i is row hits[i][1] of tensors[hits[i][0]]: the rows of (possibly differently coded) tensors as
    one BlockCodes layout, same fp32 values.

    A fused linear may mix block types (Q4_K_M stores some v or down projections as Q6_K): the
    common layout takes the smallest group (a group of 32 becomes two of 16 with the same scale),
    int8 codes if any row is signed (unsigned codes here are < 32) and a zero minimum for rows
    without one (w + 0.0 == w). Rows are gathered per source tensor, not one by one.
    """
    groups = rows_by_tensor(hits)
    used = [tensors[ti] for ti in groups]
    group = min(t.codes.shape[-1] for t in used)
    signed = any(t.codes.dtype == torch.int8 for t in used)
    with_min = any(t.minimum is not None for t in used)
    n, k = len(hits), used[0].codes.shape[1] * used[0].codes.shape[2]
    codes = torch.empty(n, k // group, group, dtype=torch.int8 if signed else used[0].codes.dtype)
    scale = torch.empty(n, k // group, 1)
    minimum = torch.zeros(n, k // group, 1) if with_min else None
    for ti, (out_rows, src_rows) in groups.items():
        t, at, src = tensors[ti], torch.tensor(out_rows), torch.tensor(src_rows)
        rep = t.codes.shape[-1] // group
        split = (lambda a: a.repeat_interleave(rep, 1)) if rep > 1 else (lambda a: a)  # noqa: E731
        codes[at] = t.codes[src].reshape(len(src_rows), -1, group).to(codes.dtype)
        scale[at] = split(t.scale[src])
        if t.minimum is not None:
            minimum[at] = split(t.minimum[src])
    return codes, scale, minimum


def row_index(tensors: list[BlockCodes]) -> dict[int, tuple[int, int]]:
    """{hash of a row's expanded fp32 values: (index in tensors, row)}, the first of equal rows."""
    return _first_rows([_row_keys(t.dequantize()) for t in tensors])


def _first_rows(keys: list[list[int]]) -> dict[int, tuple[int, int]]:
    """keys [per tensor, per row] -> {key: (tensor, row)}, the first of equal keys."""
    where: dict[int, tuple[int, int]] = {}
    for ti, rows in enumerate(keys):
        for ri, key in enumerate(rows):
            where.setdefault(key, (ti, ri))
    return where


def _checked(weight: Tensor, tensors: list[BlockCodes], hits: list) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """The codes of the rows `hits` [(tensor, row) per weight row] in one layout, if every row was found
    and they expand to `weight` bit for bit; else None."""
    if not hits or None in hits:
        return None
    codes, scale, minimum = _stack_rows(tensors, hits)
    return (codes, scale, minimum) if torch.equal(BlockCodes(codes, scale, minimum).dequantize(), weight) else None


def attach_codes(model: nn.Module, path: str | Path) -> int:
    """Give the model's fp32 linears `codes`, `code_scale`, `code_min` buffers from a GGUF file.

    A linear gets them only if every one of its rows is found among the file's tensors and the
    expanded codes equal its weight exactly (a bias, if any, stays as it is). Returns how many
    linears got codes.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu" and m.in_features % BLOCK == 0]
    if not linears:
        return 0
    tensors = read_codes(path)
    sampled = [_row_keys(_sampled(t)) for t in tensors]  # per tensor, per row
    where = _first_rows(sampled)  # candidate rows by a sample of each row; checked whole below
    done = 0
    for lin in linears:
        keys = _row_keys(lin.weight, sample=True)
        found = _checked(lin.weight, tensors, [where.get(key) for key in keys])
        if found is None and any(key in where for key in keys):  # rows with alike ends: look again by
            wanted = set(keys)  # whole rows, among every tensor with a row of one of these samples
            named = [i for i, rows in enumerate(sampled) if wanted.intersection(rows)]
            whole = {k: (named[t], r) for k, (t, r) in row_index([tensors[i] for i in named]).items()}
            found = _checked(lin.weight, tensors, [whole.get(key) for key in _row_keys(lin.weight)])
        if found is None:
            continue
        for name, buf in zip(("codes", "code_scale", "code_min"), found):
            lin.register_buffer(name, buf, persistent=False)
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
    return torch.view_as_real(torch.view_as_complex(x.contiguous().reshape(*x.shape[:-1], -1, 2))).reshape(x.shape)


ROW_INVARIANT_DTYPES = (torch.bfloat16, torch.float16)
CODED_ROWS = 16  # compiled steps of up to this many token rows read the block codes (see coded_matvec); chosen
# by measurement (AMD EPYC, 2 cores; docs/history.md): coded against the dense fp32 GEMM, SmolLM2 9.0 / 11.1 /
# 16.5 / 28.4 / 40.0 / 50.6 ms for 1 / 2 / 4 / 8 / 12 / 16 rows against 9.6 / 47.2 / 52.1 / 60.6 / 57.7 / 67.6;
# Qwen2.5-Coder-1.5B 450 / 574 ms for 12 / 16 rows against 611 / 748 (both compute-bound past a few rows)


def project(lin: nn.Module, x: Tensor) -> Tensor:
    """lin(x), except that a step of up to CODED_ROWS rows under torch.compile reads the block codes (if attached),
    that a linear bound to the kernel bf16_rows (models.prepare) runs calls of up to bf16_rows.ROWS_MAX rows on
    it, and that otherwise a single bf16/fp16 row on a CPU runs as two (a zero row added).

    Why two rows: CPU GEMMs in reduced precision give every row the same bits for any row count >= 2,
    but one row takes a GEMV path that sums in another order, and bf16 outputs round those last-bit
    differences into different values. A target's one-token step (vanilla decoding) must give exactly
    what its k-token verification gives for the same row, or greedy chains drift from vanilla on
    near-ties; padding costs nothing measurable on memory-bound models (the weights are read once).
    """
    codes = getattr(lin, "codes", None)  # a Tensor buffer from attach_codes (QuantLinear.codes is a method)
    if isinstance(codes, Tensor) and x.shape[-2] <= CODED_ROWS and x.dim() == 3 and torch.compiler.is_compiling():
        y = coded_matvec(_realized(x), codes, lin.code_scale, lin.code_min)  # [B, M, N]
        return y if lin.bias is None else y + lin.bias
    if (getattr(lin, bf16_rows.MARK, False) and x.dtype == lin.weight.dtype == torch.bfloat16
            and x.device.type == lin.weight.device.type == "cpu"  # still where bind() found it
            and x.numel() <= bf16_rows.ROWS_MAX * x.shape[-1]  # longer prefills: oneDNN
            and not (x.requires_grad or lin.weight.requires_grad)):  # the kernel has no backward
        return bf16_rows.linear(x, lin.weight, lin.bias)  # row-invariant by construction
    if (x.numel() == x.shape[-1] and x.dim() >= 2 and x.dtype in ROW_INVARIANT_DTYPES
            and x.device.type == "cpu" and type(lin) is nn.Linear):
        return lin(torch.cat((x, torch.zeros_like(x)), dim=-2)).narrow(-2, 0, 1)  # [.., 2, N] -> [.., 1, N]
    return lin(x)
