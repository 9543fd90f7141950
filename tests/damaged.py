"""Tiny weight files, good and damaged (random bytes, truncated), for the bad-input tests."""
from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers import tiny_hf_folder


def damage(src: Path, dst: Path, how: str) -> Path:
    """dst = src cut in half ('trunc') or 8 KiB of bytes that are no file format ('rand')."""
    data = src.read_bytes()
    dst.write_bytes(data[:len(data) // 2] if how == "trunc" else bytes(range(256)) * 32)
    return dst


def write_weight_files(d: Path, **folder_kw) -> Path:
    """In d: a model folder m/ (and m_rand/, m_trunc/ with a damaged shard), its quantized copy
    q.safetensors and a drafter head h.safetensors (and their _rand / _trunc variants)."""
    import torch

    from polybasic.models import load_model
    from polybasic.models.eagle_head import DrafterConfig, EagleHead, save_head
    from polybasic.quant import QuantConfig, quantize_, save_quantized

    tiny_hf_folder(d / "m", **folder_kw)
    for how in ("rand", "trunc"):
        shutil.copytree(d / "m", d / f"m_{how}")
        damage(d / "m" / "model.safetensors", d / f"m_{how}" / "model.safetensors", how)
    lm = load_model(str(d / "m"))
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=16, kernel="dequant")
    save_quantized(quantize_(lm.model, cfg), d / "q.safetensors", cfg, source=str(d / "m"))
    torch.manual_seed(0)
    save_head(d / "h.safetensors", EagleHead(DrafterConfig.for_base(lm.args)))
    for name in ("q", "h"):
        for how in ("rand", "trunc"):
            damage(d / f"{name}.safetensors", d / f"{name}_{how}.safetensors", how)
    return d
