"""Quantized linears with real low-bit kernels.

Every module keeps the same portable, kernel-independent persistent state, so one checkpoint runs
with any kernel (calibrate on one machine, execute with another kernel elsewhere):
  qweight  [out, in/2] uint8 (two signed 4-bit codes per byte, see primitives.pack_int4) for
           w_bits=4, or [out, in] int8 for w_bits=8
  scale    [out, G] fp32      zero [out, G] int8 (fp32 when config.float_zero)      bias [out] (optional)
Kernel-specific layouts are non-persistent buffers rebuilt by `prepare()` after construction and
after every load_state_dict (a post-hook), so meta-device build + load(assign=True) works.

Kernels:
  Int4PackLinear  int4 weight x float activation (aten._weight_int4pack_mm[_for_cpu]); weight-only:
                  activations run in their own dtype whatever a_bits says (docs/architecture.md).
  W4A8Linear      CPU: int4 codes x int8 activations per group of 32 (quant.w4a8, AVX-512 VNNI, built on
                  first use); falls back to Int4PackLinear's kernel where it cannot run.
  Int8MMLinear    int8 x int8 -> int32 (torch._int_mm) carrying 4- or 8-bit codes; per-token
                  dynamic activation quantization; per-channel weights only.
  DequantLinear   portable fallback: dequantize to the activation dtype, then F.linear (activations
                  fake-quantized per token when a_bits < 16).
Notes: on CPU (torch 2.13) torch._int_mm accepts any M (checked M = 1..20), so rows are padded to
17 only on CUDA. Int4PackLinear keeps the portable codes beside the kernel's packed copy (1 byte
per weight in total); Int8MMLinear with w_bits=8 shares them.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polybasic.config import INT4PACK_GROUP_SIZES, QuantConfig
from polybasic.errors import ConfigError
import polybasic.quant.w4a8 as w4a8
from polybasic.quant.primitives import (
    dequantize_weight,
    fake_quantize_activation,
    pack_int4,
    quantize_activation,
    quantize_weight,
    resolve_group_size,
    unpack_int4,
)

CUDA_INNER_K_TILES = (8, 4, 2)  # the CUDA tinygemm layout's tile counts, best first (gpt-fast / torchao use 8)


def cuda_inner_k_tiles(in_features: int) -> int | None:
    """The largest CUDA tile count whose 16 * tiles divides in_features (SmolLM2's 576 = 4 x 144: 4),
    None if none does."""
    return next((t for t in CUDA_INNER_K_TILES if in_features % (16 * t) == 0), None)


class QuantLinear(nn.Module):
    """Base: portable state, constructors, state round trip. Subclasses set `kernel` and forward."""

    kernel = "base"
    fallback_hint = "use kernel: auto (falls back to dequant per layer) or exclude the layer with filter_fn"

    def __init__(self, in_features: int, out_features: int, config: QuantConfig, bias: bool = False,
                 bias_dtype: torch.dtype = torch.float32, device=None, name: str = "linear") -> None:
        super().__init__()
        self.in_features, self.out_features, self.name = in_features, out_features, name
        self.w_bits, self.a_bits = config.w_bits, config.a_bits
        self.w_symmetric, self.a_symmetric = config.w_symmetric, config.a_symmetric
        self.group_size = resolve_group_size(in_features, config.group_size, name)
        if self.w_bits == 4 and in_features % 2:
            raise ConfigError(f"{name}: 4-bit weights need an even in_features, got {in_features}; "
                              "exclude this layer with filter_fn")
        why = self.check_shape(in_features, out_features, config, device or "cpu", name)
        if why:
            raise ConfigError(f"{name}: kernel '{self.kernel}' {why}; {self.fallback_hint}")
        n_groups = in_features // self.group_size
        qshape = (out_features, in_features // 2) if self.w_bits == 4 else (out_features, in_features)
        qdtype = torch.uint8 if self.w_bits == 4 else torch.int8
        self.register_buffer("qweight", torch.zeros(qshape, dtype=qdtype, device=device))
        self.register_buffer("scale", torch.ones(out_features, n_groups, device=device))
        self.zero_dtype = torch.float32 if config.float_zero else torch.int8
        self.register_buffer("zero", torch.zeros(out_features, n_groups, dtype=self.zero_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.register_load_state_dict_post_hook(lambda mod, _keys: mod.prepare())

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def check_shape(cls, in_features: int, out_features: int, config: QuantConfig,
                    device: torch.device, name: str) -> str | None:
        """Why this kernel cannot run this layer (None if it can)."""
        return None

    @classmethod
    def from_quantized(cls, q: Tensor, scale: Tensor, zero: Tensor, config: QuantConfig,
                       bias: Tensor | None = None, name: str = "linear") -> "QuantLinear":
        """From codes q [out, in] int8, scale [out, G], zero [out, G] (e.g. after calibration)."""
        out, k = q.shape
        mod = cls(k, out, config, bias is not None, bias.dtype if bias is not None else torch.float32,
                  q.device, name)
        if scale.shape != mod.scale.shape or zero.shape != mod.zero.shape:
            raise ConfigError(f"{name}: scale/zero shapes {tuple(scale.shape)}/{tuple(zero.shape)} do "
                              f"not match group_size={config.group_size} (expected "
                              f"{tuple(mod.scale.shape)}); quantize with the same config")
        # stored contiguous whatever the float weight's layout, so a saved and reloaded copy is the same tensor
        mod.qweight = (pack_int4(q) if config.w_bits == 4 else q.to(torch.int8)).contiguous()
        mod.scale, mod.zero = scale.float().contiguous(), zero.to(mod.zero_dtype).contiguous()
        if bias is not None:
            mod.bias.data.copy_(bias.detach())
        mod.prepare()
        return mod

    @classmethod
    def from_float(cls, linear: nn.Linear, config: QuantConfig, name: str = "linear") -> "QuantLinear":
        """Round-to-nearest quantization of an nn.Linear's weight."""
        q, scale, zero = quantize_weight(linear.weight.detach(), config.w_bits, config.group_size,
                                         config.w_symmetric, name=name)
        return cls.from_quantized(q, scale, zero, config, linear.bias, name)

    # ---- state ---------------------------------------------------------------------------------
    def codes(self) -> Tensor:
        """Signed integer codes [out, in] int8."""
        return unpack_int4(self.qweight) if self.w_bits == 4 else self.qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32, rows: Tensor | None = None) -> Tensor:
        """The weight this module represents, [out, in] (the reference for every kernel); rows: only these [R]."""
        w = dequantize_weight(self.codes(), self.scale, self.zero, dtype)
        return w if rows is None else w[rows]

    def prepare(self) -> None:
        """Rebuild kernel-specific buffers from the portable state (no-op on the meta device)."""

    def _add_bias(self, y: Tensor) -> Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        g = "ch" if self.group_size == self.in_features else self.group_size
        return (f"in={self.in_features}, out={self.out_features}, w{self.w_bits}a{self.a_bits}, "
                f"group={g}, w_sym={self.w_symmetric}, a_sym={self.a_symmetric}, "
                f"kernel={self.kernel}, bias={self.bias is not None}")


class DequantLinear(QuantLinear):
    kernel = "dequant"

    def forward(self, x: Tensor) -> Tensor:  # x [..., in] -> [..., out]
        w = self.dequantized_weight(x.dtype)  # [out, in]
        x = fake_quantize_activation(x, self.a_bits, self.a_symmetric)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class Int4PackLinear(QuantLinear):
    """tinygemm layout: w = (u - 8) * s + z with u = q + 8 in [0, 15]; so s = scale, z = -zero*scale."""

    kernel = "int4pack"
    _mm = None  # the device's int4pack matmul and from how many rows a dense GEMM runs instead (None: never),
    _dense_rows: int | None = None  # both bound by prepare() for the packed weights' device
    gemm_rows = 128  # CPU: from this many rows on, dequantize to x.dtype and run one GEMM (see dense_weight)
    keep_dense = False  # keep that expanded weight after the first prefill (see keep_dense_for_prefill)
    _dense: Tensor | None = None

    @classmethod
    def check_shape(cls, in_features, out_features, config, device, name):
        dev = torch.device(device).type
        if config.w_bits != 4:
            return f"needs w_bits=4, got {config.w_bits}"
        if dev not in ("cpu", "cuda", "meta"):
            return f"runs on cpu or cuda, not {dev}"
        g = in_features if config.group_size == -1 else config.group_size
        if g not in INT4PACK_GROUP_SIZES:
            return f"group size {g} is not one of {INT4PACK_GROUP_SIZES}"
        if out_features % 16:
            return f"out_features={out_features} is not a multiple of 16"
        if dev == "cuda" and cuda_inner_k_tiles(in_features) is None:
            return f"cuda needs in_features % {16 * CUDA_INNER_K_TILES[-1]} == 0, got {in_features}"
        return None

    def __init__(self, in_features, out_features, config, bias=False, bias_dtype=torch.float32,
                 device=None, name="linear"):
        super().__init__(in_features, out_features, config, bias, bias_dtype, device, name)
        self.register_buffer("packed", torch.empty(0, dtype=torch.uint8, device=device), persistent=False)
        self.register_buffer("scales_and_zeros", torch.empty(0, device=device), persistent=False)

    def _scales_and_zeros(self, dtype: torch.dtype) -> Tensor:
        s = self.scale.float()  # [out, G]
        z = -self.zero.float() * s
        return torch.stack((s, z), dim=-1).transpose(0, 1).contiguous().to(dtype)  # [G, out, 2]

    def prepare(self) -> None:
        if self.qweight.is_meta:
            return
        u = self._unsigned_codes()  # [out, in] in [0, 15]
        if self.qweight.device.type == "cuda":  # checked by the gpu tests (tests/gpu), not on a CPU
            u8 = (u[:, 0::2] << 4 | u[:, 1::2]).to(torch.uint8)  # [out, in/2], high nibble first
            self.packed = torch.ops.aten._convert_weight_to_int4pack(u8, cuda_inner_k_tiles(self.in_features))
            self._mm, self._dense_rows = torch.ops.aten._weight_int4pack_mm, None
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 2)
            self._mm, self._dense_rows = torch.ops.aten._weight_int4pack_mm_for_cpu, self.gemm_rows
        dt = self.scales_and_zeros.dtype if self.scales_and_zeros.is_floating_point() else torch.bfloat16
        self.scales_and_zeros = self._scales_and_zeros(dt)

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        """The weight [out, in] in `dtype`, expanded for a prefill GEMM: u * s + (-(8 + zero) * s) with
        u the stored nibbles, in `dtype` arithmetic (~4x faster than dequantized_weight's fp32 path;
        within a rounding of it). On a 2-core AMD EPYC (no AMX), for a 1536 x 8960 layer at 256 rows:
        kernel 113 ms, this + bf16 GEMM ~78 ms, the fp32 dequantization + GEMM 270 ms; even at 128 rows."""
        out, k, g = self.out_features, self.in_features, self.group_size
        s = self.scale.to(dtype).unsqueeze(-1)  # [out, G, 1]
        off = self._offsets().to(dtype).unsqueeze(-1)  # [out, G, 1]
        p = self.qweight  # [out, in/2] uint8, low nibble = even column
        u = torch.stack(((p & 0xF).to(dtype), (p >> 4).to(dtype)), -1).view(out, k // g, g)  # [out, G, g]
        return torch.addcmul(off, u, s).view(out, k)

    def _unsigned_codes(self) -> Tensor:
        """u = q + 8 [out, in] uint8 in [0, 15]: the codes every int4 layout packs, read off qweight's nibbles
        (low = even column) as stored, without unpacking to signed codes and back (a W4 0.5B's 97 linears:
        ~1 s -> ~0.1 s at load)."""
        p = self.qweight  # [out, in/2]
        return torch.stack((p & 0xF, p >> 4), -1).view(self.out_features, self.in_features)

    def _offsets(self) -> Tensor:
        """o [out, G] fp32 with w = s * u + o per group: -(8 + zero) * scale."""
        return -(8 + self.zero.float()) * self.scale

    def forward(self, x: Tensor) -> Tensor:  # x [..., in] -> [..., out], computed in x.dtype
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self._dense_rows is not None and x2.shape[0] >= self._dense_rows and x.dtype != torch.float32:
            y = self._dense_mm(x2)  # CPU prefill: a bf16 GEMM beats the kernel
        else:
            y = self._kernel_mm(x2)
        return self._add_bias(y.reshape(*x.shape[:-1], self.out_features))

    def _dense_mm(self, x2: Tensor) -> Tensor:  # [M, in] -> [M, out] through the expanded weight
        w = self._dense if self._dense is not None and self._dense.dtype == x2.dtype else self.dense_weight(x2.dtype)
        if self.keep_dense:
            self._dense = w
        return F.linear(x2, w)

    def _kernel_mm(self, x2: Tensor) -> Tensor:  # [M, in] -> [M, out]: the kernel prepare() bound for the device
        if self.scales_and_zeros.dtype != x2.dtype:  # rebuild once per dtype change, from fp32 scales
            self.scales_and_zeros = self._scales_and_zeros(x2.dtype)
        return self._mm(x2, self.packed, self.group_size, self.scales_and_zeros)


class W4A8Linear(Int4PackLinear):
    """CPU: 4-bit codes x int8 activations, quantized per group of 32 at every call whatever a_bits says
    (quant.w4a8: AVX-512 VNNI, built on first use). Where that cannot run (no compiler, no VNNI, not a
    CPU), it runs torch's int4 kernel as Int4PackLinear does, and says so once. The kernel keeps the
    scales and offsets as 8 bits times an fp16 factor per 256 columns (quant.w4a8.factor). Unlike
    Int4PackLinear's, its long prefills stay on the kernel, which keeps them row-invariant and needs no expanded
    bf16 weight (2 bytes a weight): a W4 0.5B's eager prefill took 444 / 1,578 ms on it against 437 / 1,738 ms
    on the dense GEMM with the weight kept expanded (201 / 671 tokens, 2-core AMD EPYC). Measured on a 2-core AMD EPYC
    over Qwen2.5-Coder-1.5B's linears (experiments.w4a8_kernel): 1.20x torch's int4 kernel at 1 row,
    1.31x at 2, 1.61x at 4, 1.80x at 8."""

    kernel = "w4a8"

    def __init__(self, in_features, out_features, config, bias=False, bias_dtype=torch.float32,
                 device=None, name="linear"):
        super().__init__(in_features, out_features, config, bias, bias_dtype, device, name)
        # the kernel's layout (quant.w4a8.pack), None where torch's int4 kernel runs; a buffer, so that a
        # compiled step takes it as an input (a plain tensor attribute costs a guard per layer and call)
        self.register_buffer("tiles", None, persistent=False)

    @classmethod
    def check_shape(cls, in_features, out_features, config, device, name):
        if config.w_bits != 4 or (config.group_size if config.group_size != -1 else in_features) != 32:
            return f"needs w_bits=4 in groups of 32, got w{config.w_bits} group_size={config.group_size}"
        if torch.device(device).type not in ("cpu", "meta"):
            return f"runs on cpu, not {torch.device(device).type}"
        if out_features % 16 or in_features % 32:
            return f"needs out_features % 16 == 0 and in_features % 32 == 0, got {out_features} x {in_features}"
        return None

    def prepare(self) -> None:
        if self.qweight.is_meta:
            return
        ok, why = w4a8.status() if self.qweight.device.type == "cpu" else (False, "its weights are not on a CPU")
        if not ok:
            _warn_once(f"kernel 'w4a8' cannot run here ({why}); its layers run torch's int4 kernel instead")
            self.tiles = None
            return super().prepare()
        self.tiles = w4a8.pack(self._unsigned_codes(), self.scale, self._offsets())  # w = s * u + o
        self._dense_rows = None  # every row count on the kernel (see the class)

    def _kernel_mm(self, x2: Tensor) -> Tensor:
        return super()._kernel_mm(x2) if self.tiles is None else w4a8.mm(x2, self.tiles)

    def kernel_path(self) -> str:
        """Which code computes this linear here (models.prepare.kernel_paths)."""
        return "w4a8 4-bit tiles (AVX-512 VNNI)" if self.tiles is not None else "torch int4pack (w4a8 cannot run here)"


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def keep_dense_for_prefill(model: nn.Module) -> int:
    """Let every CPU int4pack linear of `model` keep its expanded weight after its first prefill: long
    prompts then run at the dense GEMM's speed (on a 2-core AMD EPYC, a 0.5B copy's 256-token prefill
    2.5 s -> ~0.9 s) for 2 more bytes per weight of memory; one-token steps still read the int4 codes.
    For chain levels, whose prefill of every prompt sits on the request's critical path. Returns how
    many linears keep theirs."""
    mods = [m for m in model.modules() if isinstance(m, Int4PackLinear) and m._dense_rows is not None]
    for m in mods:
        m.keep_dense = True
    return len(mods)


class Int8MMLinear(QuantLinear):
    """y = sx * sw * sum_k (qx - zx)(qw - zw), expanded so the int32 GEMM sees raw codes:
    sum qx qw - zw * rowsum(qx) - zx * colsum(qw) + K zx zw (all int32, exact)."""

    kernel = "int8mm"

    @classmethod
    def check_shape(cls, in_features, out_features, config, device, name):
        if config.w_bits > 8 or config.a_bits > 8:
            return f"needs w_bits and a_bits <= 8, got w{config.w_bits}a{config.a_bits}"
        if config.group_size != -1 and config.group_size != in_features:
            return f"needs per-channel weights (group_size -1), got {config.group_size}"
        if config.float_zero:
            return "needs integer zero points (method 'gguf' has float ones)"
        if torch.device(device).type == "cuda" and (in_features % 8 or out_features % 8):
            return "cuda needs in_features and out_features multiples of 8"
        return None

    fallback_hint = "use kernel: dequant or auto"

    def __init__(self, in_features, out_features, config, bias=False, bias_dtype=torch.float32,
                 device=None, name="linear"):
        super().__init__(in_features, out_features, config, bias, bias_dtype, device, name)
        self.register_buffer("w_int8", torch.empty(0, dtype=torch.int8, device=device), persistent=False)
        self.register_buffer("w_colsum", torch.empty(0, dtype=torch.int32, device=device), persistent=False)

    def prepare(self) -> None:
        if self.qweight.is_meta:
            return
        w = self.codes()  # [out, in] int8 (shares qweight's storage for w_bits=8)
        self.w_int8 = w
        self.w_colsum = w.sum(1, dtype=torch.int32)  # [out]

    def forward(self, x: Tensor) -> Tensor:  # x [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        qx, sx, zx = quantize_activation(x2, self.a_bits, self.a_symmetric)  # [M,in] [M,1] [M,1]
        m = qx.shape[0]
        if x.device.type == "cuda" and m <= 16:  # cuBLASLt int8 GEMM needs M > 16
            qx = F.pad(qx, (0, 0, 0, 17 - m))
        acc = torch._int_mm(qx, self.w_int8.t())[:m]  # [M, out] int32
        zw = self.zero.view(1, -1).to(torch.int32)  # [1, out]
        if not self.a_symmetric:
            acc = acc - zx * self.w_colsum.view(1, -1)
        if not self.w_symmetric:
            acc = acc - qx[:m].sum(-1, keepdim=True, dtype=torch.int32) * zw + self.in_features * zx * zw
        y = acc.float() * sx * self.scale.view(1, -1)  # [M, out] fp32
        return self._add_bias(y.to(x.dtype).reshape(*x.shape[:-1], self.out_features))


KERNEL_CLASSES: dict[str, type[QuantLinear]] = {
    "dequant": DequantLinear, "int4pack": Int4PackLinear, "int8mm": Int8MMLinear, "w4a8": W4A8Linear}


def choose_kernel(config: QuantConfig, in_features: int, out_features: int, device,
                  name: str = "linear", dtype: torch.dtype = torch.bfloat16) -> str:
    """Resolve config.kernel for one layer whose activations have `dtype`. 'auto' honours both
    w_bits and a_bits: int4pack for w4a16 in bf16/fp16 (with fp32 activations the CPU kernel has
    no fast path: measured ~4x slower than fp32 F.linear), int8mm for per-channel W(4|8)A(4|8),
    dequant otherwise or when the shape does not fit. An explicit kernel that cannot run the
    layer raises ConfigError naming it."""
    if config.kernel != "auto":
        why = KERNEL_CLASSES[config.kernel].check_shape(in_features, out_features, config, device, name)
        if why:
            raise ConfigError(f"{name}: kernel '{config.kernel}' {why}; use kernel: auto (falls back "
                              "to dequant per layer) or exclude the layer with filter_fn")
        return config.kernel
    w4a16 = config.a_bits == 16 and config.w_bits == 4 and dtype != torch.float32
    if w4a16 and not Int4PackLinear.check_shape(in_features, out_features, config, device, name):
        return "int4pack"
    if config.a_bits <= 8 and not Int8MMLinear.check_shape(in_features, out_features, config, device, name):
        return "int8mm"
    return "dequant"
