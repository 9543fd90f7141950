"""Quantization math: pure functions, no modules, no state.

Conventions (shared by every kernel and by calibration):
- Integer codes are signed, q in [qmin, qmax] = [-2^(b-1), 2^(b-1)-1]; value = (q - zero) * scale.
- Symmetric: zero = 0, scale = absmax / qmax. Asymmetric: the range [min, max] is first widened to
  contain 0 (so 0.0 is exact and the integer zero point fits in [qmin, qmax]), then
  scale = (max - min) / (qmax - qmin), zero = qmin - round(min / scale).
- Weights [out, in] are quantized per group of `group_size` consecutive input channels
  (-1 = one group per output channel); activations [..., in] per token (dynamic, last dim).
- All arithmetic is fp32 whatever the input dtype; scales are fp32, zero points integers.
- A group size that does not divide in_features is an error (ConfigError naming the layer and
  the valid sizes): no padding, no partial last group, so every kernel sees the same groups.
"""
from __future__ import annotations

import torch
from torch import Tensor

from polybasic.errors import ConfigError

SCALE_EPS = 1e-8  # floor of every scale (an all-zero group quantizes to zeros, not NaN)


def qrange(bits: int) -> tuple[int, int]:
    """Signed integer range of `bits`-bit codes."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def round_ste(x: Tensor) -> Tensor:
    """round(x) forward, identity gradient backward (straight-through estimator)."""
    return x + (x.round() - x).detach()


def resolve_group_size(in_features: int, group_size: int, name: str = "weight") -> int:
    """The effective group size (-1 -> in_features); ConfigError if it does not divide in_features."""
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g:
        valid = [d for d in range(1, in_features + 1) if in_features % d == 0 and d >= 8]
        raise ConfigError(f"{name}: group_size {group_size} does not divide in_features={in_features}; "
                          f"use -1 (per channel) or one of {valid}")
    return g


def _qparams(lo: Tensor, hi: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """scale, float-valued integer zero from the (clipped) range [lo, hi]; lo <= 0 <= hi; fp32."""
    qmin, qmax = qrange(bits)
    if symmetric:
        scale = (torch.maximum(-lo, hi) / qmax).clamp(min=SCALE_EPS)
        return scale, torch.zeros_like(scale)
    scale = ((hi - lo) / (qmax - qmin)).clamp(min=SCALE_EPS)
    zero = (qmin - round_ste(lo / scale)).clamp(qmin, qmax)
    return scale, zero


def _group_range(wg: Tensor, gamma: Tensor | None, beta: Tensor | None) -> tuple[Tensor, Tensor]:
    """wg [out, G, gs] fp32 -> lo, hi [out, G, 1] with 0 inside; optional LWC factors [out, G]."""
    lo = wg.amin(-1, keepdim=True).clamp(max=0)
    hi = wg.amax(-1, keepdim=True).clamp(min=0)
    if gamma is not None:  # OmniQuant learnable weight clipping: shrink the range by sigmoid factors
        hi = hi * torch.sigmoid(gamma.float()).unsqueeze(-1)
    if beta is not None:
        lo = lo * torch.sigmoid(beta.float()).unsqueeze(-1)
    return lo, hi


def weight_qparams(w: Tensor, bits: int, group_size: int, symmetric: bool,
                   gamma: Tensor | None = None, beta: Tensor | None = None,
                   name: str = "weight") -> tuple[Tensor, Tensor]:
    """w [out, in] -> scale, zero [out, G] fp32 (zero integer-valued; differentiable via STE).

    gamma, beta [out, G]: learnable clipping logits (hi *= sigmoid(gamma), lo *= sigmoid(beta));
    symmetric modes clip |w| by sigmoid(gamma) and ignore beta.
    """
    out, k = w.shape
    gs = resolve_group_size(k, group_size, name)
    wg = w.float().reshape(out, k // gs, gs)  # [out, G, gs]
    if symmetric:
        lo, hi = _group_range(wg, None, None)
        hi = torch.maximum(-lo, hi)
        if gamma is not None:
            hi = hi * torch.sigmoid(gamma.float()).unsqueeze(-1)
        lo = -hi
    else:
        lo, hi = _group_range(wg, gamma, beta)
    scale, zero = _qparams(lo, hi, bits, symmetric)
    return scale.squeeze(-1), zero.squeeze(-1)


def fake_quantize_weight(w: Tensor, bits: int, group_size: int, symmetric: bool,
                         gamma: Tensor | None = None, beta: Tensor | None = None,
                         name: str = "weight") -> Tensor:
    """Quantize then dequantize w [out, in] (same dtype out); gradients flow to w, gamma, beta."""
    out, k = w.shape
    scale, zero = weight_qparams(w, bits, group_size, symmetric, gamma, beta, name)  # [out, G]
    qmin, qmax = qrange(bits)
    wg = w.float().reshape(out, scale.shape[1], -1)  # [out, G, gs]
    s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
    q = (round_ste(wg / s) + z).clamp(qmin, qmax)
    return ((q - z) * s).reshape(out, k).to(w.dtype)


@torch.no_grad()
def quantize_weight(w: Tensor, bits: int, group_size: int, symmetric: bool,
                    gamma: Tensor | None = None, beta: Tensor | None = None,
                    name: str = "weight") -> tuple[Tensor, Tensor, Tensor]:
    """w [out, in] -> q int8 [out, in], scale fp32 [out, G], zero int8 [out, G]."""
    out, k = w.shape
    scale, zero = weight_qparams(w, bits, group_size, symmetric, gamma, beta, name)
    qmin, qmax = qrange(bits)
    wg = w.float().reshape(out, scale.shape[1], -1)  # [out, G, gs]
    q = (torch.round(wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(qmin, qmax)
    return q.reshape(out, k).to(torch.int8), scale, zero.to(torch.int8)


def dequantize_weight(q: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q [out, in] int, scale [out, G], zero [out, G] -> w [out, in] in dtype (math in fp32)."""
    out, k = q.shape
    g = scale.shape[1]
    qg = q.reshape(out, g, k // g).float()  # [out, G, gs]
    w = (qg - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.reshape(out, k).to(dtype)


def activation_qparams(x: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor]:
    """x [..., in] -> per-token scale, zero [..., 1] fp32 (zero integer-valued)."""
    xf = x.float()
    lo = xf.amin(-1, keepdim=True).clamp(max=0)
    hi = xf.amax(-1, keepdim=True).clamp(min=0)
    if symmetric:
        lo = -torch.maximum(-lo, hi)
    return _qparams(lo, hi, bits, symmetric)


def quantize_activation(x: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., in] -> q int8 [..., in], scale fp32 [..., 1], zero int32 [..., 1] (per token)."""
    qmin, qmax = qrange(bits)
    scale, zero = activation_qparams(x, bits, symmetric)
    q = (torch.round(x.float() / scale) + zero).clamp(qmin, qmax)
    return q.to(torch.int8), scale, zero.to(torch.int32)


def fake_quantize_activation(x: Tensor, bits: int, symmetric: bool) -> Tensor:
    """Per-token quantize-dequantize of x [..., in] (same dtype out; STE gradient); bits=16: x."""
    if bits >= 16:
        return x
    qmin, qmax = qrange(bits)
    scale, zero = activation_qparams(x, bits, symmetric)
    q = (round_ste(x.float() / scale) + zero).clamp(qmin, qmax)
    return ((q - zero) * scale).to(x.dtype)


def pack_int4(q: Tensor) -> Tensor:
    """Signed 4-bit codes q [..., 2n] (int8 in [-8, 7]) -> uint8 [..., n]; low nibble = even index."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: Tensor) -> Tensor:
    """Inverse of pack_int4: uint8 [..., n] -> int8 [..., 2n] in [-8, 7]."""
    lo = (p & 0xF).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)
