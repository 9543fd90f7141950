"""Plain dataclass describing a decoder-only transformer (Llama family)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from polybasic.errors import ConfigError, check

ARGS_VERSION = 1


_SHAPE_SIZES = ("vocab_size", "dim", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "max_seq_len")


@dataclass(kw_only=True)
class BlockShape:
    """The decoder-block geometry a base model and its drafter head share."""
    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048

    def check_shape(self, owner: str, fix: str) -> None:
        """Every size positive and the kv heads dividing the heads; errors name `owner.field`."""
        for name in _SHAPE_SIZES:
            check(getattr(self, name) > 0, f"{owner}.{name}", f"must be > 0, got {getattr(self, name)}", fix)
        check(self.n_heads % self.n_kv_heads == 0, f"{owner}.n_kv_heads",
              f"{self.n_kv_heads} does not divide n_heads={self.n_heads}", fix)

    def shape(self) -> dict:
        """The BlockShape fields alone, e.g. to build one kind of config from another."""
        return {f.name: getattr(self, f.name) for f in fields(BlockShape)}


@dataclass(kw_only=True)
class ModelArgs(BlockShape):
    n_layers: int
    tie_embeddings: bool = False
    family: str = "llama"
    version: int = ARGS_VERSION

    def __post_init__(self) -> None:
        self.check_shape("ModelArgs", "fix the model config")
        check(self.n_layers > 0, "ModelArgs.n_layers", f"must be > 0, got {self.n_layers}", "fix the model config")
        check(self.version == ARGS_VERSION, "ModelArgs.version",
              f"is {self.version}, this polybasic reads version {ARGS_VERSION}", "re-export the model")

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelArgs":
        """Build from a transformers LlamaConfig (or a compatible config)."""
        mtype = getattr(cfg, "model_type", "llama")
        if mtype not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"model_type: '{mtype}' is not supported by the lean decoder (supported: "
                f"{', '.join(SUPPORTED_FAMILIES)}); use a Llama-architecture model")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        scaling = getattr(cfg, "rope_scaling", None)
        if rope_type != "default" or (isinstance(scaling, dict) and scaling.get("rope_type", "default") != "default"):
            raise ConfigError(f"rope_scaling: rope type '{rope_type}' is not implemented; "
                              "use a model with default RoPE")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(cfg, "rope_theta", 10000.0)
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                raise ConfigError(f"{flag}: biases are not implemented in the lean decoder")
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        return cls(
            vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
            n_heads=n_heads, n_kv_heads=getattr(cfg, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim, intermediate_size=cfg.intermediate_size, rope_theta=float(theta),
            norm_eps=float(cfg.rms_norm_eps), max_seq_len=int(cfg.max_position_embeddings),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)), family=mtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"ModelArgs: unknown fields {sorted(unknown)}; the file was written by "
                              "a newer polybasic, upgrade it")
        return cls(**d)


SUPPORTED_FAMILIES = ("llama",)
