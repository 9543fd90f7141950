"""Per-device preparation of a loaded model: the layouts and kernels each device runs fastest,
chosen once at load time instead of by branches in `forward`.

CPU: fp32 linears in the transposed decode layout (see decoder.use_decode_layout), bf16 linears on the
row-invariant kernel bf16_rows where the CPU has AVX-512 BF16 (bf16_rows.choice); quantized linears
bind their CPU kernels (int4pack's CPU packing, and a dequantized GEMM for long bf16 prefills, see
quant.linear); compiled steps (models.static) of up to gguf_codes.CODED_ROWS tokens read the GGUF's
block codes, and use inductor's C++ wrapper. CUDA: plain contiguous layouts and the CUDA kernels; compiled steps are
captured as CUDA graphs.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from polybasic.errors import ConfigError
from polybasic.models import bf16_rows
from polybasic.models.decoder import use_decode_layout
from polybasic.models.eagle_head import EagleHead


# cpp_wrapper: the C++ wrapper cuts the compiled CPU step's Python overhead. emulate_precision_casts: fused
# pointwise code rounds each op's result to bf16 as eager PyTorch does (rope's products, silu * up), so a compiled
# step whose reductions are all row-invariant kernels (bf16_rows, w4a8) gets eager's bits exactly.
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True, "emulate_precision_casts": True}
COMPILED_DEVICES = ("cpu", "cuda")


def prepare_for_device(model: nn.Module) -> nn.Module:
    """Give `model` (already on its device) the layouts and kernels of that device; values unchanged.
    Idempotent: quantized linears bound their kernels when their state was loaded (QuantLinear.prepare)."""
    model = use_decode_layout(model)
    bf16_rows.bind(model)
    return model


def inductor_options(device: str | torch.device) -> dict | None:
    """The inductor options compiled steps use on `device`."""
    return CPU_INDUCTOR_OPTIONS if torch.device(device).type == "cpu" else None


def compile_for_device(model, gguf: str | Path | None = None, flag: str = "--compile", sizes=None,
                       notify=None) -> int:
    """Run every forward of `model` (a lean decoder or an EAGLE head) through static-shape compiled steps
    (models.static) the way its device supports; returns how many linears read GGUF block codes."""
    device = model.fc.weight.device if isinstance(model, EagleHead) else model.device
    check_compilable(device, flag)
    if isinstance(model, EagleHead):
        model.compile_steps(inductor_options(device), sizes, notify)
        return 0
    return model.compile_steps(gguf, inductor_options(device), sizes, notify)


def check_compilable(device: str | torch.device, flag: str = "--compile") -> None:
    """Raise a ConfigError naming `flag` unless compiled steps are prepared for `device` (cheap: call it
    before loading anything)."""
    dev = torch.device(device)
    if dev.type not in COMPILED_DEVICES:
        raise ConfigError(f"{flag}: compiled steps are prepared for {' and '.join(COMPILED_DEVICES)}, not "
                          f"{dev.type}; drop it on this device")
