"""Model families: what the lean decoder needs to know about one transformers architecture.

A `Family` maps a transformers config to `ModelArgs`, a transformers state dict to the lean
decoder's names, and names the decoder block its layers (and calibration, and drafter heads built
on it) use. GGUF files reach us through transformers' GGUF converter (HF names) and their block
codes are matched to the lean weights by content (models.gguf_codes), so `gguf_arch` only names the
file's `general.architecture`.

Adding a family = one module in this package that defines a `Family` (reuse the Llama pieces for
what it shares) plus one entry in `FAMILIES` below, keyed by the config's `model_type`.
"""
from __future__ import annotations

from torch import nn

from polybasic.errors import ConfigError
from polybasic.models.args import ModelArgs
from polybasic.models.families import llama, qwen2
from polybasic.models.families.family import Family

FAMILIES: dict[str, Family] = {f.model_type: f for f in (llama.FAMILY, qwen2.FAMILY)}


def family_for(model_type: str) -> Family:
    """The family of a transformers `model_type`; ConfigError naming the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type: '{model_type}' is not supported by the lean decoder (supported: "
                          f"{', '.join(FAMILIES)}); use a model of one of these families")
    return FAMILIES[model_type]


def block_for(args) -> nn.Module:
    """A new decoder block of args.family, shaped by args (a ModelArgs or any BlockShape)."""
    return family_for(args.family).block(args)


def args_from_hf_config(cfg) -> ModelArgs:
    """ModelArgs from a transformers config, through its family (ConfigError for other model types)."""
    return family_for(getattr(cfg, "model_type", "llama")).args_from_config(cfg)


__all__ = ["Family", "FAMILIES", "family_for", "block_for", "args_from_hf_config"]
