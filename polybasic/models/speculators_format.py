"""EAGLE-3 heads (models.eagle_head.Eagle3Head) in the speculators format, both ways: the folder
(config.json + model.safetensors) that vLLM serves as an eagle3 drafter and the speculators library
loads. It imports torch, safetensors and polybasic's head, never transformers or lightning: a serving
environment holding polybasic's export code only imports it.

config.json (speculators 0.9 `Eagle3SpeculatorConfig`; vLLM 0.32 reads it in
vllm/transformers_utils/configs/speculators/algos.py, update_eagle3):
  speculators_model_type "eagle3"; speculators_config {algorithm, proposal_methods [greedy,
  speculative_tokens k], verifier {name_or_path, architectures}}; transformer_layer_config, a one-layer
  llama config shaped like the head (attention_bias: q/k/v biases, Qwen2 heads); draft_vocab_size;
  eagle_aux_hidden_state_layer_ids = feature_layers + 1 (vLLM's aux hidden state of layer id i is the
  input of decoder layer i, our layer i-1's output); norm_before_residual false, written because vLLM
  takes an absent key as true; norm_before_fc, fc_norm, norm_output false.
model.safetensors (ours on the right):
  fc.weight [E, nE]                                   fc.weight
  layers.0.input_layernorm.weight [E]                 layers.0.attention_norm.weight (on the embedding)
  layers.0.hidden_norm.weight [E]                     layers.0.hidden_norm.weight
  layers.0.self_attn.{q,k,v}_proj.weight [HD|GD, 2E]  rows of layers.0.attention.wqkv.weight (.bias too)
  layers.0.self_attn.o_proj.weight [E, HD]            layers.0.attention.wo.weight (zero .bias with q/k/v biases)
  layers.0.post_attention_layernorm.weight [E]        layers.0.ffn_norm.weight
  layers.0.mlp.{gate,up}_proj.weight [I, E]           halves of layers.0.feed_forward.w13.weight
  layers.0.mlp.down_proj.weight [E, I]                layers.0.feed_forward.w2.weight
  norm.weight [E], lm_head.weight [N, E]              norm.weight, lm_head.weight
  d2t [N] int64, target id - draft id (vLLM adds it)  d2t (draft id -> target id)
  t2d [V] bool, the draft vocabulary's target ids      -
d2t and t2d only with a reduced draft vocabulary. No embed_tokens: vLLM then shares the target's
embedding, as our head does (a folder that has one, e.g. saved by speculators, loads; it is not read).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from polybasic.artifacts import atomic_path, save_safetensors, write_text
from polybasic.errors import ConfigError, check
from polybasic.models.args import ModelArgs
from polybasic.models.decoder import Transformer
from polybasic.models.eagle_head import DrafterConfig, EagleHead, eagle3_layers, head_from_state_dict
from polybasic.models.preflight import read_json, safetensors_header

CONFIG, WEIGHTS = "config.json", "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes
FIX = "export the head again: polybasic export RECIPE --format speculators"
_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors dtype -> config dtype
_L = "layers.0."


def _pieces(cfg: DrafterConfig) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """speculators tensor -> (our tensor, the first of its rows there, its shape); in row order."""
    e, n, i = cfg.dim, len(cfg.feature_layers), cfg.intermediate_size
    hd, gd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    qkv = {"q": (0, hd), "k": (hd, gd), "v": (hd + gd, gd)}
    out = {"fc.weight": ("fc.weight", 0, (e, n * e)),
           _L + "input_layernorm.weight": (_L + "attention_norm.weight", 0, (e,)),
           _L + "hidden_norm.weight": (_L + "hidden_norm.weight", 0, (e,))}
    for x, (row, rows) in qkv.items():
        out[f"{_L}self_attn.{x}_proj.weight"] = (_L + "attention.wqkv.weight", row, (rows, 2 * e))
        if cfg.qkv_bias:
            out[f"{_L}self_attn.{x}_proj.bias"] = (_L + "attention.wqkv.bias", row, (rows,))
    out.update({_L + "self_attn.o_proj.weight": (_L + "attention.wo.weight", 0, (e, hd)),
                _L + "post_attention_layernorm.weight": (_L + "ffn_norm.weight", 0, (e,)),
                _L + "mlp.gate_proj.weight": (_L + "feed_forward.w13.weight", 0, (i, e)),
                _L + "mlp.up_proj.weight": (_L + "feed_forward.w13.weight", i, (i, e)),
                _L + "mlp.down_proj.weight": (_L + "feed_forward.w2.weight", 0, (e, i)),
                "norm.weight": ("norm.weight", 0, (e,)),
                "lm_head.weight": ("lm_head.weight", 0, (cfg.draft_vocab_size or cfg.vocab_size, e))})
    return out


def _extra_shapes(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors besides _pieces: name -> (shape, safetensors dtype)."""
    out = {}
    if cfg.qkv_bias:  # llama's attention_bias also biases o_proj: zero
        out[_L + "self_attn.o_proj.bias"] = ((cfg.dim,), "")
    if cfg.draft_vocab_size:
        out.update({"d2t": ((cfg.draft_vocab_size,), "I64"), "t2d": ((cfg.vocab_size,), "BOOL")})
    return out


def check_target(cfg: DrafterConfig, target: ModelArgs, name: str = "the target") -> None:
    """ConfigError naming the field when a head was not trained on `target` (hidden size, vocabulary,
    the layers it reads)."""
    fix = f"export a head trained on {name}"
    check(cfg.dim == target.dim, "DrafterConfig.dim", f"is {cfg.dim}, the hidden_size of {name} is {target.dim}: "
          "the head was trained on another model", fix)
    check(cfg.vocab_size == target.vocab_size, "DrafterConfig.vocab_size", f"is {cfg.vocab_size}, the vocab_size "
          f"of {name} is {target.vocab_size}: the head was trained on another model", fix)
    check(max(cfg.feature_layers, default=0) <= target.n_layers - 2, "DrafterConfig.feature_layers",
          f"{cfg.feature_layers} read layers {name} ({target.n_layers} layers) does not have below its last", fix)


def save_speculators(head: EagleHead, folder: str | Path, verifier_name_or_path: str, k: int = 3,
                     target: ModelArgs | None = None, verifier_architectures: list[str] | None = None) -> Path:
    """Write an eagle3 head as a speculators folder (replacing one there; atomically). verifier: the target's
    HF id or folder (architectures read from its config.json when not given); k: the draft length vLLM
    defaults to; target: the target's args, checked against the head (default: the base it is bound to)."""
    cfg = head.cfg
    check(cfg.arch == "eagle3", "DrafterConfig.arch", f"is {cfg.arch}; vLLM and speculators load EAGLE-3 heads "
          "only", "train one with distill.head_arch: eagle3")
    target = target or (head.base.args if head.base is not None else None)
    if target is not None:
        check_target(cfg, target, repr(verifier_name_or_path))
    sd = head.state_dict()
    tensors = {name: _cpu(sd[ours].narrow(0, row, shape[0])) for name, (ours, row, shape) in _pieces(cfg).items()}
    if cfg.qkv_bias:
        tensors[_L + "self_attn.o_proj.bias"] = torch.zeros(cfg.dim, dtype=sd["fc.weight"].dtype)
    if cfg.draft_vocab_size:
        d2t = sd["d2t"].cpu().long()  # [N] target ids
        tensors["d2t"] = d2t - torch.arange(cfg.draft_vocab_size)
        tensors["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, d2t, True)
    if verifier_architectures is None:
        vcfg = Path(verifier_name_or_path) / CONFIG
        verifier_architectures = json.loads(vcfg.read_text()).get("architectures") or [] if vcfg.is_file() else []
    config = _config(cfg, verifier_name_or_path, verifier_architectures, k, str(sd["fc.weight"].dtype).split(".")[-1])
    folder = Path(folder)
    with atomic_path(folder) as tmp:
        save_safetensors(tmp / WEIGHTS, tensors, {"format": "pt"})  # transformers reads the format key
        write_text(tmp / CONFIG, json.dumps(config, indent=2) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
    return folder


def _cpu(t: Tensor) -> Tensor:
    """A contiguous CPU copy that shares no memory (safetensors refuses shared tensors)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _config(cfg: DrafterConfig, verifier: str, architectures: list[str], k: int, dtype: str) -> dict:
    layer = {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
             "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
             "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
             "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
             "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
             "attention_bias": cfg.qkv_bias, "mlp_bias": False, "tie_word_embeddings": False}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "dtype": dtype,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                                   "verifier": {"name_or_path": verifier, "architectures": architectures}},
            "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.feature_layers], **_FLAGS}


def read_config(folder: str | Path, base: Transformer | None = None) -> DrafterConfig:
    """The DrafterConfig of a speculators folder, every field polybasic's eagle3 layer depends on checked
    (base: the target, for folders that leave the aux layer ids to the verifier's default)."""
    path = Path(folder) / CONFIG
    c = read_json(path, "speculators", "pass a folder written by `polybasic export RECIPE --format speculators` "
                  "(or by speculators)", FIX)
    where = f"speculators: {path}"
    check(isinstance(c, dict) and c.get("speculators_model_type") == "eagle3", f"{where}: speculators_model_type",
          f"is {c.get('speculators_model_type') if isinstance(c, dict) else None!r}", "polybasic reads eagle3 heads")
    t = c.get("transformer_layer_config")
    check(isinstance(t, dict) and t.get("model_type", "llama") == "llama", f"{where}: transformer_layer_config",
          f"has model_type {t.get('model_type') if isinstance(t, dict) else None!r}",
          "polybasic reads llama-layer heads")
    for key, want in _FLAGS.items():
        got = c.get(key, key == "norm_before_residual")  # vLLM's defaults
        check(got == want, f"{where}: {key}", f"is {got}, which polybasic's eagle3 layer does not compute",
              f"use a head with {key}: {want}")
    check(c.get("target_hidden_size") in (None, t.get("hidden_size")), f"{where}: target_hidden_size",
          f"is {c.get('target_hidden_size')}, not the head's hidden_size", "use a head as wide as its target")
    for key, want in (("num_hidden_layers", 1), ("hidden_act", "silu"), ("mlp_bias", False)):
        check(t.get(key, want) == want, f"{where}: transformer_layer_config.{key}", f"is {t.get(key)!r}",
              f"polybasic's eagle3 head has {key} {want}")
    ids = c.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        check(base is not None, f"{where}: eagle_aux_hidden_state_layer_ids", "is not set (the verifier's default)",
              "pass base= (the target) to load it, or write the layer ids")
        layers = eagle3_layers(base.args.n_layers)
    else:
        check(all(isinstance(i, int) and i >= 1 for i in ids), f"{where}: eagle_aux_hidden_state_layer_ids",
              f"is {ids}; id 0 (the embedding) is not a layer polybasic's decoder returns", "use ids >= 1")
        layers = [i - 1 for i in ids]
    rope = t.get("rope_parameters") or {}
    check(rope.get("rope_type", "default") == "default", f"{where}: transformer_layer_config.rope_parameters",
          f"has rope_type {rope.get('rope_type')!r}", "polybasic's heads use default RoPE")
    try:
        n_heads = t["num_attention_heads"]
        draft = int(c.get("draft_vocab_size") or t["vocab_size"])
        theta = float(rope.get("rope_theta") or t.get("rope_theta", 10000.0))
        return DrafterConfig(
            arch="eagle3", vocab_size=t["vocab_size"], dim=t["hidden_size"], n_heads=n_heads,
            n_kv_heads=t.get("num_key_value_heads") or n_heads,
            head_dim=t.get("head_dim") or t["hidden_size"] // n_heads,
            intermediate_size=t["intermediate_size"], rope_theta=theta,
            norm_eps=float(t.get("rms_norm_eps", 1e-6)), max_seq_len=int(t.get("max_position_embeddings", 2048)),
            qkv_bias=bool(t.get("attention_bias", False)),
            family="qwen2" if t.get("attention_bias") else "llama",  # our families differ by q/k/v biases alone
            draft_vocab_size=0 if draft == t["vocab_size"] else draft, feature_layers=layers)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{where}: transformer_layer_config lacks {e}; {FIX}") from None


def check_weights(folder: str | Path, cfg: DrafterConfig) -> None:
    """Every tensor of the format is in the folder's model.safetensors with its shape (by the header: nothing
    loads); ConfigError naming the first one missing or misshapen."""
    path = Path(folder) / WEIGHTS
    header = safetensors_header(path, FIX)
    want = {name: (shape, "") for name, (_, _, shape) in _pieces(cfg).items()} | _extra_shapes(cfg)
    for name, (shape, dtype) in want.items():
        got = header.get(name)
        if got is None:
            raise ConfigError(f"speculators: {path} has no tensor '{name}' (shape {list(shape)}); the folder is "
                              f"incomplete or not this head's: {FIX}")
        if tuple(got["shape"]) != shape or (dtype and got["dtype"] != dtype):
            raise ConfigError(f"speculators: {path}: tensor '{name}' is {got['dtype']} {got['shape']}, the config "
                              f"says {dtype or 'float'} {list(shape)}; {FIX}")


def load_speculators(folder: str | Path, base: Transformer | None = None) -> EagleHead:
    """The Eagle3Head of a speculators folder; config and every tensor's name and shape are checked before
    any weight loads. base: the target (bound to it, in its dtype and device; its sizes are checked)."""
    cfg = read_config(folder, base)
    if base is not None:
        check_target(cfg, base.args)
    check_weights(folder, cfg)
    stored = load_file(str(Path(folder) / WEIGHTS))
    where = f"speculators: {Path(folder) / WEIGHTS}"
    if cfg.qkv_bias:
        check(not stored[_L + "self_attn.o_proj.bias"].any(), f"{where}: {_L}self_attn.o_proj.bias",
              "is not zero, and polybasic's attention has no output bias", "use a head without one")
    sd: dict[str, list[tuple[int, Tensor]]] = {}
    for name, (ours, row, _) in _pieces(cfg).items():
        sd.setdefault(ours, []).append((row, stored[name]))
    state = {ours: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) if len(parts) > 1 else parts[0][1]
             for ours, parts in sd.items()}
    if cfg.draft_vocab_size:
        d2t = stored["d2t"].long() + torch.arange(cfg.draft_vocab_size)  # [N] target ids
        ok = bool(((d2t >= 0) & (d2t < cfg.vocab_size)).all()) and d2t.unique().numel() == d2t.numel()
        check(ok and torch.equal(stored["t2d"].bool().nonzero().flatten(), d2t.sort().values),
              f"{where}: d2t", "maps draft ids to target ids that are out of range, repeated or not t2d's",
              FIX)
        state["d2t"] = d2t
    return head_from_state_dict(cfg, state, base)
