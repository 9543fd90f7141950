"""Plain dataclass describing a decoder-only transformer of one family (see models.families)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from polybasic.errors import ConfigError, check

ARGS_VERSION = 1
FAMILY_NAMES = ("llama", "qwen2")  # the keys of models.families.FAMILIES (checked there)


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
    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    family: str = "llama"  # key of models.families.FAMILIES: which block the layers are

    def check_shape(self, owner: str, fix: str) -> None:
        """Every size positive and the kv heads dividing the heads; errors name `owner.field`."""
        for name in _SHAPE_SIZES:
            check(getattr(self, name) > 0, f"{owner}.{name}", f"must be > 0, got {getattr(self, name)}", fix)
        check(self.n_heads % self.n_kv_heads == 0, f"{owner}.n_kv_heads",
              f"{self.n_kv_heads} does not divide n_heads={self.n_heads}", fix)
        check(self.family in FAMILY_NAMES, f"{owner}.family", f"unknown family {self.family!r}",
              f"use one of {', '.join(FAMILY_NAMES)}")

    def shape(self) -> dict:
        """The BlockShape fields alone, e.g. to build one kind of config from another."""
        return {f.name: getattr(self, f.name) for f in fields(BlockShape)}


@dataclass(kw_only=True)
class ModelArgs(BlockShape):
    n_layers: int
    tie_embeddings: bool = False
    version: int = ARGS_VERSION

    def __post_init__(self) -> None:
        self.check_shape("ModelArgs", "fix the model config")
        check(self.n_layers > 0, "ModelArgs.n_layers", f"must be > 0, got {self.n_layers}", "fix the model config")
        check(self.version == ARGS_VERSION, "ModelArgs.version",
              f"is {self.version}, this polybasic reads version {ARGS_VERSION}", "re-export the model")

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

