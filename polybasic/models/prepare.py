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

import logging
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from polybasic.config import COMPILE_MODES
from polybasic.errors import ConfigError
from polybasic.models import bf16_rows
from polybasic.models.blocks import Attention, RMSNorm
from polybasic.models.decoder import use_decode_layout
from polybasic.models.eagle_head import EagleHead
from polybasic.models.gguf_codes import ROW_INVARIANT_DTYPES
from polybasic.models.native import cpu_flags, trust_probed_vec_isa

log = logging.getLogger(__name__)


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


def kernel_paths(model: nn.Module) -> dict[str, str]:
    """Which code computes each kind of op of `model` (a lean decoder) where it is, in words: {'linears', 'lm head',
    'attention', 'norms', 'pointwise (compiled)', 'cpu'}, e.g. for a test to print beside a row-invariance failure.
    Paths whose bf16 rows are not row-invariant say so (see `row_variant_ops`)."""
    linears = Counter(_linear_path(m) for name, m in model.named_modules() if _is_linear(m) and name != "output")
    row_attention = [getattr(m, bf16_rows.ATTEND) for m in model.modules() if isinstance(m, Attention)]
    row_norm = [getattr(m, bf16_rows.NORM) for m in model.modules() if isinstance(m, RMSNorm)]
    flags = set(cpu_flags().split())
    return {
        "linears": "; ".join(f"{n} x {path}" for path, n in linears.items()),
        "lm head": _linear_path(model.output),
        "attention": f"bf16_rows.attend ({bf16_rows.isa()} build), each row alone" if row_attention and all(row_attention) else
        "SDPA one row at a time (eager), masked_attention's matmuls and softmax (compiled): not row-invariant",
        "norms": f"bf16_rows.norm ({bf16_rows.isa()} build), each row alone" if row_norm and all(row_norm) else
        "F.rms_norm (eager), inductor's reduction (compiled)",
        "pointwise (compiled)": f"inductor C++ ({_vec_isa()}), rounded as eager (emulate_precision_casts)",
        "cpu": f"{torch.backends.cpu.get_cpu_capability()}; "
               + (", ".join(sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512_vnni",
                                                                       "avx512_fp16")))) or "no AVX-512 BF16/VNNI")}


def row_variant_ops(model: nn.Module) -> list[str]:
    """The ops of a bf16/fp16 CPU decoder that do not run on a row-invariant kernel (w4a8, bf16_rows), so that a row's
    bits could change with the row count of a call; [] for a model whose every row is computed as if alone (and for
    fp32 or CUDA models, which promise no such thing)."""
    if model.device.type != "cpu" or model.dtype not in ROW_INVARIANT_DTYPES:
        return []
    bad = [name or "output" for name, m in model.named_modules()
           if _is_linear(m) and not _linear_path(m).startswith(("w4a8", "bf16_rows"))]
    bad += [f"{name} (attention)" for name, m in model.named_modules()
            if isinstance(m, Attention) and not getattr(m, bf16_rows.ATTEND)]
    bad += [f"{name} (norm)" for name, m in model.named_modules()
            if isinstance(m, RMSNorm) and not getattr(m, bf16_rows.NORM)]
    return bad


def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or hasattr(mod, "kernel_path") or hasattr(mod, "kernel")


def _linear_path(mod: nn.Module) -> str:
    if hasattr(mod, "kernel_path"):  # the GGUF codes and W4 copies on w4a8 (quant)
        return mod.kernel_path()
    if getattr(mod, bf16_rows.MARK, False):
        return f"bf16_rows ({bf16_rows.isa()} build) up to {bf16_rows.ROWS_MAX} rows, oneDNN above"
    w = getattr(mod, "weight", None)
    if w is None or type(mod) is not nn.Linear:
        return f"{getattr(mod, 'kernel', type(mod).__name__)} (quantized)"
    if w.device.type == "cpu" and w.dtype in ROW_INVARIANT_DTYPES:
        return f"oneDNN {str(w.dtype).removeprefix('torch.')} GEMM (its kernel depends on the row count)"
    return f"torch {str(w.dtype).removeprefix('torch.')} GEMM on {w.device.type}"


def _vec_isa() -> str:
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa  # torch internals, and start-up time
        return str(pick_vec_isa()) or "no vector ISA"
    except (ImportError, AttributeError):
        return "unknown vector ISA"


def inductor_options(device: str | torch.device) -> dict | None:
    """The inductor options compiled steps use on `device`."""
    return CPU_INDUCTOR_OPTIONS if torch.device(device).type == "cpu" else None


def compile_for_device(model, gguf: str | Path | None = None, flag: str = "--compile", sizes=None,
                       notify=None, mode: str = "layers") -> int:
    """Run every forward of `model` (a lean decoder or an EAGLE head) through static-shape compiled steps
    (models.static) the way its device supports; returns how many linears read GGUF block codes. mode (the CPU):
    'layers' compiles one graph per size for a decoder layer, run by every layer (seconds to compile); 'whole' one
    graph of the whole model per size (minutes to compile, ~3% faster steps on a 2-core CPU; docs/results.md)."""
    device = model.device
    check_compilable(device, flag)
    if mode not in COMPILE_MODES:
        raise ConfigError(f"{flag}: compile mode {mode!r}; use one of {', '.join(COMPILE_MODES)}")
    if device.type == "cpu":
        trust_probed_vec_isa()
    if isinstance(model, EagleHead):
        model.compile_steps(inductor_options(device), sizes, notify)
        return 0
    variant = row_variant_ops(model)
    if variant:
        log.warning("compiled steps of this %s model are not row-invariant (%s run neither bf16_rows nor w4a8; "
                    "$%s=onednn, or the kernel cannot run here): a chain's verifications may give other bits "
                    "than its one-token steps, and its tokens other than plain decoding's", model.dtype,
                    ", ".join(variant[:3]) + (f" and {len(variant) - 3} more" if len(variant) > 3 else ""),
                    bf16_rows.CHOICE_ENV)
    return model.compile_steps(gguf, inductor_options(device), sizes, notify, regions=mode != "whole")


def check_compilable(device: str | torch.device, flag: str = "--compile") -> None:
    """Raise a ConfigError naming `flag` unless compiled steps are prepared for `device` (cheap: call it
    before loading anything)."""
    dev = torch.device(device)
    if dev.type not in COMPILED_DEVICES:
        raise ConfigError(f"{flag}: compiled steps are prepared for {' and '.join(COMPILED_DEVICES)}, not "
                          f"{dev.type}; drop it on this device")
