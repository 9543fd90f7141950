"""The Qwen2 family (Qwen2, Qwen2.5, Qwen2.5-Coder): the Llama block with q/k/v biases.

Differences from Llama that matter here: q/k/v projections have biases (o_proj and the MLP do
not), RoPE base from the config (1e6 in Qwen2.5), tied or untied LM head, and an optional sliding
window that these models leave off (refused when on: not implemented). The chat template travels
with the tokenizer (in the GGUF for packaged models).
"""
from __future__ import annotations

from polybasic.errors import ConfigError
from polybasic.models.args import ModelArgs
from polybasic.models.blocks import Block
from polybasic.models.families.family import Family
from polybasic.models.families.llama import common_args, hf_to_lean


def args_from_config(cfg) -> ModelArgs:
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ConfigError("use_sliding_window: the config enables sliding-window attention for model_type "
                          "'qwen2', which the lean decoder does not implement; use a model with full "
                          "attention in every layer")
    return common_args(cfg, "qwen2", qkv_bias=True)


FAMILY = Family(model_type="qwen2", gguf_arch="qwen2", args_from_config=args_from_config,
                hf_to_lean=hf_to_lean, block=Block)
