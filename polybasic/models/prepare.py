"""Per-device preparation of a loaded model: the layouts and kernels each device runs fastest,
chosen once at load time instead of by branches in `forward`.

CPU: fp32 linears in the transposed decode layout (see llama.use_decode_layout); quantized linears
bind their CPU kernels (int4pack's CPU packing, and a dequantized GEMM for long bf16 prefills, see
quant.linear); the compiled one-token step reads the GGUF's block codes and uses inductor's C++
wrapper. CUDA: plain contiguous layouts and the CUDA kernels; no compiled step yet (CUDA graphs are
future work, so asking for one there is a clear error rather than an untested path).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from polybasic.errors import ConfigError
from polybasic.models.decoder import use_decode_layout

CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True}  # the C++ wrapper cuts the compiled CPU step's Python overhead


def prepare_for_device(model: nn.Module) -> nn.Module:
    """Give `model` (already on its device) the layouts and kernels of that device; values unchanged.
    Idempotent: quantized linears bound their kernels when their state was loaded (QuantLinear.prepare)."""
    return use_decode_layout(model)


def compile_for_device(model, gguf: str | Path | None = None, flag: str = "--compile") -> int:
    """Compile `model`'s one-token step the way its device supports; returns how many linears read
    GGUF block codes (CPU only). On CUDA: a ConfigError naming `flag` (not built yet)."""
    check_compilable(model.device, flag)
    return model.compile_decode(gguf, CPU_INDUCTOR_OPTIONS)


def check_compilable(device: str | torch.device, flag: str = "--compile") -> None:
    """Raise a ConfigError naming `flag` unless the compiled step is prepared for `device` (cheap: call
    it before loading anything)."""
    dev = torch.device(device)
    if dev.type != "cpu":
        raise ConfigError(f"{flag}: the compiled one-token step is prepared for the CPU only (on {dev} it "
                          "would need CUDA graphs and static caches, not built yet); drop it on this device")
