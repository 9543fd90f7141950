"""The Llama family (SmolLM2, Llama 2/3 with default RoPE): the reference for the others."""
from __future__ import annotations

import torch
from torch import Tensor

from polybasic.errors import ConfigError
from polybasic.models.args import ModelArgs
from polybasic.models.blocks import Block
from polybasic.models.families.family import Family


def rope_theta(cfg) -> float:
    """The config's RoPE base; ConfigError for any scaled RoPE (not implemented)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    scaling = getattr(cfg, "rope_scaling", None)
    if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
        raise ConfigError(f"rope_scaling: rope type '{rope_type}' is not implemented; "
                          "use a model with default RoPE")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta or getattr(cfg, "rope_theta", 10000.0))


def refuse_flags(cfg, *flags: str) -> None:
    """ConfigError naming the first config flag that is set (a feature the lean block lacks)."""
    for flag in flags:
        if getattr(cfg, flag, False):
            raise ConfigError(f"{flag}: is set in the model config, and the lean decoder does not "
                              f"implement it for model_type '{cfg.model_type}'")


def common_args(cfg, family: str, **extra) -> ModelArgs:
    """ModelArgs from the config fields every Llama-like family shares."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act: '{act}' is not implemented (the lean block uses silu)")
    n_heads = cfg.num_attention_heads
    return ModelArgs(
        vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
        n_heads=n_heads, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads,
        intermediate_size=cfg.intermediate_size, rope_theta=rope_theta(cfg),
        norm_eps=float(cfg.rms_norm_eps), max_seq_len=int(cfg.max_position_embeddings),
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), family=family, **extra)


def args_from_config(cfg) -> ModelArgs:
    refuse_flags(cfg, "attention_bias", "mlp_bias")  # HF Llama's attention_bias also biases o_proj
    return common_args(cfg, "llama")


def hf_to_lean(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Map a transformers Llama-layout state dict onto ours (fusing q/k/v and gate/up; q/k/v
    biases too when args.qkv_bias)."""
    out = {"tok_embeddings.weight": sd["model.embed_tokens.weight"],
           "norm.weight": sd["model.norm.weight"]}
    if not args.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(args.n_layers):
        p = f"model.layers.{i}."
        q = f"layers.{i}."
        attn = [p + f"self_attn.{x}_proj." for x in "qkv"]
        out[q + "attention.wqkv.weight"] = torch.cat([sd[a + "weight"] for a in attn])
        if args.qkv_bias:
            out[q + "attention.wqkv.bias"] = torch.cat([sd[a + "bias"] for a in attn])
        out[q + "attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[q + "feed_forward.w13.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out[q + "feed_forward.w2.weight"] = sd[p + "mlp.down_proj.weight"]
        out[q + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


FAMILY = Family(model_type="llama", gguf_arch="llama", args_from_config=args_from_config,
                hf_to_lean=hf_to_lean, block=Block)
