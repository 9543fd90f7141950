"""Quantization method 'gguf': a W4 copy that keeps a GGUF file's own 4-bit codes.

A model loaded from a GGUF file already sits on that file's grids: Q4_K stores every row as
sub-blocks of 32 codes c in [0, 15] with value = S * c + m (S = d * sc, m = -dmin * mn, both exact in
fp32). Re-quantizing those values with another grid (RTN, group 64, integer zero point) rounds them a
second time; here the codes are taken as they are, so the copy computes the file's own weights up to
the kernel's bf16 scales. In polybasic's convention value = (q - zero) * scale with q = c - 8:
scale = S and zero = -8 - m / S, a float zero point (QuantConfig.float_zero).

Rows the file holds on another grid (Q6_K, Q8_0, F16: in Q4_K_M files the LM head or embedding and
about half of the v and down projections) get round-to-nearest 4-bit codes per group of 32 with a
float zero point (the group's minimum exactly). Rows are found by the fp32 values they expand to, as
models.gguf_codes.attach_codes does, so fused linears (wqkv, w13) need no name mapping.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from polybasic.models.gguf_codes import _row_keys, read_codes, row_index, rows_by_tensor
from polybasic.quant.primitives import SCALE_EPS

log = logging.getLogger(__name__)

GROUP = 32
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # 4-bit codes in groups of 32 sharing a scale (and a minimum)


def rtn_float_zero(w: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor]:
    """w [out, in] -> q int8 [out, in] in [-8, 7], scale [out, G] fp32, zero [out, G] fp32: the
    group's range [min, max] in 15 steps, min exactly representable (q = -8)."""
    out, k = w.shape
    wg = w.float().reshape(out, k // group, group)  # [out, G, g]
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)  # [out, G, 1]
    scale = ((hi - lo) / 15).clamp(min=SCALE_EPS)
    q = (torch.round((wg - lo) / scale) - 8).clamp(-8, 7)
    zero = -8 - lo / scale
    return q.reshape(out, k).to(torch.int8), scale.squeeze(-1), zero.squeeze(-1)


@dataclass
class GGUFCodes:
    """The 4-bit rows of a GGUF file, keyed by the fp32 values they expand to.

    `quantize(w)` is a drop-in for primitives.quantize_weight at 4 bits, group 32, float zero points.
    `exact` / `total` count the weights taken from the file's codes and all weights quantized.
    """

    path: Path
    codes: list[Tensor] = field(default_factory=list)  # per 4-bit tensor: [N, K/32, 32] int8 in [-8, 7]
    scale: list[Tensor] = field(default_factory=list)  # [N, K/32] fp32
    zero: list[Tensor] = field(default_factory=list)  # [N, K/32] fp32
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # row hash -> (tensor, row)
    exact: int = 0
    total: int = 0

    @classmethod
    def read(cls, path: str | Path) -> "GGUFCodes":
        self = cls(Path(path))
        four = [t for t in read_codes(path) if t.kind in FOUR_BIT]  # Q5_*, Q6_K, Q8_0: rounded by quantize()
        for t in four:
            unsigned = t.kind != "Q4_0"  # Q4_1 / Q4_K: c in [0, 15] with a minimum; Q4_0: c - 8, none
            q = (t.codes.to(torch.int16) - 8).to(torch.int8) if unsigned else t.codes.to(torch.int8)
            s = t.scale.squeeze(-1)  # [N, K/32]; may be negative (d is any f16), only 0 is replaced
            s = torch.where(s == 0, torch.full_like(s, SCALE_EPS), s)
            # value = S*c + m = (q - zero) * S with q = c - 8  ->  zero = -8 - m / S
            m = t.minimum.squeeze(-1) if t.minimum is not None else torch.zeros_like(s)
            self.codes.append(q)
            self.scale.append(s)
            self.zero.append((-8 - m / s) if unsigned else torch.zeros_like(s))
        self.where = row_index(four)
        log.info("%s: %d rows held as 4-bit codes", path, len(self.where))
        return self

    def quantize(self, w: Tensor, name: str = "weight") -> tuple[Tensor, Tensor, Tensor]:
        """w [out, in] fp32 (as loaded from the file) -> q int8 [out, in], scale, zero [out, in/32]
        fp32: the file's codes for each row it holds in 4 bits, RTN (rtn_float_zero) for the rest."""
        out, k = w.shape
        q, scale, zero = rtn_float_zero(w)
        n = 0
        for ti, (mine, theirs) in rows_by_tensor([self.where.get(key) for key in _row_keys(w.float())]).items():
            if self.codes[ti].shape[1] * GROUP != k:
                continue
            src = torch.tensor(theirs)
            dst = torch.tensor(mine)
            q[dst] = self.codes[ti][src].reshape(len(mine), k)
            scale[dst], zero[dst] = self.scale[ti][src], self.zero[ti][src]
            n += len(mine)
        self.exact += n * k
        self.total += out * k
        log.debug("%s: %d of %d rows from the GGUF's 4-bit codes", name, n, out)
        return q, scale, zero

    @property
    def exact_fraction(self) -> float:
        return self.exact / self.total if self.total else 0.0
