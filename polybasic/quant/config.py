"""QuantConfig: the versioned quantization recipe saved inside every quantized checkpoint.

Calibration (`method`) and execution (`kernel`) are separate choices (ARCHITECTURE §8): a W4A4
model calibrated with AffineQuant can run on a CPU as int4-weight x bf16-activation (`int4pack`).

Integer codes are signed for every mode: q in [-2^(b-1), 2^(b-1)-1], value = (q - zero) * scale.
Symmetric modes have zero = 0 and scale = absmax / (2^(b-1)-1); asymmetric modes use the full
range with an integer zero point. Method 'gguf' keeps a GGUF file's own 4-bit codes (quant.from_gguf),
whose group minimums are not multiples of the scale: its zero points are floats (`float_zero`).
Activations are quantized per token, dynamically (at run time).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from polybasic.errors import ConfigError, check

QUANT_CONFIG_VERSION = 1
BITS = (4, 8, 16)
METHODS = ("rtn", "omniquant", "affinequant", "gguf")
UNTRAINED = ("rtn", "gguf")  # methods that learn nothing: calibration only propagates the blocks
KERNELS = ("auto", "int4pack", "int8mm", "dequant")
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class QuantConfig:
    """a_bits=16: activations not quantized (w_bits=16 is reserved, rejected for now).
    group_size: input channels per weight group, or -1 for one group per output channel.
    a_symmetric defaults to False (asymmetric): post-RMSNorm and post-SiLU activations are far
    from zero-centred, and an integer zero point is free in the int8mm kernel (row-sum trick). kernel 'int4pack' is weight-only: it runs activations in the
    model dtype whatever a_bits says (the fast CPU path of §8)."""

    w_bits: int = 4
    a_bits: int = 16
    group_size: int = 64
    w_symmetric: bool = False
    a_symmetric: bool = False
    method: str = "rtn"
    kernel: str = "auto"
    quantize_lm_head: bool = False
    version: int = QUANT_CONFIG_VERSION

    def __post_init__(self) -> None:
        f = "QuantConfig."
        check(self.version == QUANT_CONFIG_VERSION, f + "version",
              f"is {self.version}, this polybasic reads version {QUANT_CONFIG_VERSION}",
              "upgrade polybasic (newer checkpoint) or re-quantize the model")
        for name in ("w_bits", "a_bits"):
            v = getattr(self, name)
            check(isinstance(v, int) and v in BITS, f + name, f"must be one of {BITS}, got {v!r}",
                  "use 4 or 8 (16 = keep floating point)")
        check(self.w_bits != 16, f + "w_bits", "16 (float weights, activation-only quantization) is "
              "not implemented", "use w_bits 4 or 8, or leave the model unquantized")
        g = self.group_size
        check(isinstance(g, int) and (g > 0 or g == -1), f + "group_size",
              f"must be a positive int or -1, got {g!r}", "use e.g. 64, 128 or -1 (per output channel)")
        for name in ("w_symmetric", "a_symmetric", "quantize_lm_head"):
            check(isinstance(getattr(self, name), bool), f + name,
                  f"must be a bool, got {getattr(self, name)!r}", "use true or false")
        check(self.method in METHODS, f + "method", f"unknown method {self.method!r}",
              f"use one of {METHODS}")
        check(self.kernel in KERNELS, f + "kernel", f"unknown kernel {self.kernel!r}",
              f"use one of {KERNELS}")
        if self.method == "gguf":
            check(self.w_bits == 4 and g == 32 and not self.w_symmetric, f + "method",
                  f"'gguf' keeps the file's 4-bit codes in groups of 32 (asymmetric), got "
                  f"w_bits={self.w_bits}, group_size={g}, w_symmetric={self.w_symmetric}",
                  "set w_bits: 4, group_size: 32, w_symmetric: false, or use method rtn")
            check(self.kernel != "int8mm", f + "kernel", "'int8mm' needs integer zero points; method "
                  "'gguf' has float ones", "use kernel: int4pack, dequant or auto")
        if self.kernel == "int4pack":
            check(self.w_bits == 4, f + "kernel", f"'int4pack' needs w_bits=4, got {self.w_bits}",
                  "set w_bits: 4 or kernel: dequant")
            check(g in INT4PACK_GROUP_SIZES, f + "group_size",
                  f"kernel 'int4pack' supports group sizes {INT4PACK_GROUP_SIZES}, got {g}",
                  "pick one of those or kernel: dequant")
        if self.kernel == "int8mm":
            check(self.w_bits <= 8 and self.a_bits <= 8, f + "kernel",
                  f"'int8mm' needs w_bits and a_bits <= 8, got w{self.w_bits}a{self.a_bits}",
                  "use kernel: int4pack (weight-only) or dequant")
            check(g == -1, f + "group_size", f"kernel 'int8mm' needs per-channel weights, got {g}",
                  "set group_size: -1 or kernel: dequant")

    @property
    def float_zero(self) -> bool:
        """Zero points are fp32 (any real offset), not integers: method 'gguf'."""
        return self.method == "gguf"

    @property
    def name(self) -> str:
        """Short human label, e.g. 'w4a16-g64-asym' (for logs only, never for file names)."""
        g = "ch" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.w_bits}a{self.a_bits}-{g}-{'sym' if self.w_symmetric else 'asym'}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"QuantConfig: expected a mapping, got {type(d).__name__}; "
                              "pass the dict written by QuantConfig.to_dict")
        version = d.get("version", QUANT_CONFIG_VERSION)
        if isinstance(version, int) and version > QUANT_CONFIG_VERSION:
            raise ConfigError(f"QuantConfig.version: {version} is newer than this polybasic reads "
                              f"({QUANT_CONFIG_VERSION}); upgrade polybasic")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"QuantConfig: unknown fields {unknown}; remove them (known: "
                              f"{[f.name for f in fields(cls)]})")
        return cls(**d)
