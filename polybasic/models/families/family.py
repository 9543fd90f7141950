"""What the lean decoder needs to know about one transformers architecture (see models.families)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor, nn


@dataclass(frozen=True)
class Family:
    model_type: str  # transformers config.model_type
    gguf_arch: str  # GGUF general.architecture
    args_from_config: Callable[[Any], Any]  # transformers config -> ModelArgs (ConfigError if unsupported)
    hf_to_lean: Callable[[dict[str, Tensor], Any], dict[str, Tensor]]  # (HF state dict, args) -> lean names
    block: Callable[[Any], nn.Module]  # ModelArgs -> one decoder block (models.blocks.Block interface)
