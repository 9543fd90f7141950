"""EAGLE-style drafter head (after Li et al. 2024, EAGLE-1 and EAGLE-3), written for the lean decoder.

Row p of the head reads the embedding of token x_{p+1} and the base model's feature f_p, fuses
them with a linear layer (2E -> E), runs decoder blocks at position p (one, as in EAGLE-1;
`n_layers` sets more) and predicts the next feature f_{p+1}. The base's FROZEN final norm and LM
head turn a predicted feature into logits for x_{p+2}. At inference the head runs autoregressively
on its own predicted features. Embedding, final norm and LM head are the base model's, shared and
never saved in the head's checkpoint.

What we do, and how it differs from EAGLE:
- The feature f_p is the base's last decoder layer output BEFORE its final norm (what
  `Transformer.forward` returns). EAGLE-1 reads and predicts the state AFTER the final norm (the
  LM head's input) and applies the LM head to it directly; here the head predicts the pre-norm
  state and the base's final norm is applied on the way to the logits. EAGLE-3 reads a fusion of
  low, middle and high layer features and predicts no feature to be regressed at all.
- What the predicted feature is trained against is `module.TrainConfig.regress`: "prenorm"
  (default; our pre-norm feature, both sides divided by the base feature's RMS per token: not
  EAGLE-1's target), "postnorm" (the base's final norm applied to both sides: EAGLE-1's target)
  or "none" (no regression, the token loss only: EAGLE-3).
- Two options, on by default, make it learn faster on small models whose features carry a few
  huge outlier dimensions (SmolLM2: rms ~30, some dims ~1000): `input_norms`, RMS-normalised
  embedding and feature before the fuse layer (EAGLE-3 normalises both before concatenating;
  EAGLE-1 does not), and `feature_residual`, a path that adds f_p itself to the fuse layer's
  output, so the head starts from "f_{p+1} = f_p" with the outliers in place and learns the
  change (in neither EAGLE; it may bias the head towards repeating the last state).
- Optional reduced draft vocabulary (`draft_vocab_size`, EAGLE-3): the head's logits cover only
  the most frequent answer tokens of its training data.

Shapes: B batch, M rows in this call, E model dim, V vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from polybasic.artifacts import save_safetensors
from polybasic.config import check_feature_layers
from polybasic.errors import ConfigError, check
from polybasic.models.args import BlockShape, ModelArgs
from polybasic.models.blocks import KVCache, RMSNorm
from polybasic.models.decoder import Transformer
from polybasic.models.families import block_for
from polybasic.models.preflight import FIX_HEAD, corrupt_safetensors, safetensors_metadata

DRAFTER_VERSION = 2


@dataclass(kw_only=True)
class DrafterConfig(BlockShape):
    """The head's architecture (its block is shaped like one of the base's); saved as JSON in the
    checkpoint's metadata."""

    n_layers: int = 1  # decoder blocks (EAGLE uses one; small bases may need more)
    fc_bias: bool = True
    draft_vocab_size: int = 0  # > 0: draft over the N most frequent target tokens only (EAGLE-3)
    input_norms: bool = True  # RMSNorm the embedding and the feature before the fuse layer
    feature_residual: bool = True  # the block's input is f_p + fc(...), not fc(...) alone
    feature_layers: list[int] = field(default_factory=list)  # also read these base layers' outputs (EAGLE-3)
    version: int = DRAFTER_VERSION

    def __post_init__(self) -> None:
        self.check_shape("DrafterConfig", "fix the drafter config")
        check(self.n_layers >= 1, "DrafterConfig.n_layers", f"must be >= 1, got {self.n_layers}", "use e.g. 1")
        check(0 <= self.draft_vocab_size <= self.vocab_size, "DrafterConfig.draft_vocab_size",
              f"must be in [0, vocab_size={self.vocab_size}], got {self.draft_vocab_size}",
              "use 0 for the full vocabulary")
        self.feature_layers = check_feature_layers(self.feature_layers, "DrafterConfig.feature_layers")
        check(self.version == DRAFTER_VERSION, "DrafterConfig.version",
              f"is {self.version}, this polybasic reads version {DRAFTER_VERSION}",
              "retrain or convert the drafter")

    @classmethod
    def for_base(cls, args: ModelArgs, **overrides) -> "DrafterConfig":
        """A head matching a base model (its decoder block is shaped like one of the base's)."""
        return cls(**{**args.shape(), **overrides})

    def block_args(self) -> ModelArgs:
        return ModelArgs(n_layers=1, **self.shape())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        """A saved config; keys it lacks take the defaults above (every version-2 head without a
        key was trained with that default, e.g. feature_residual=True)."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"DrafterConfig: unknown fields {sorted(unknown)}; the checkpoint was written "
                              "by a newer polybasic, upgrade it")
        return cls(**d)


class _NoCache(nn.Module):
    """Stand-in for KVCache when a whole sequence is processed from position 0 (training)."""

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v


class _StepCache(nn.Module):
    """Stand-in for KVCache in `EagleHead.unroll`: every step's keys and values, concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, G, n, D] of this step -> all steps' so far [B, G, steps*n, D]."""
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)


def _rope(cfg: DrafterConfig, start: int, end: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [M, 1, D] for positions start..end-1, sin sign-folded (see llama.apply_rope)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64,
                                                 device=device).float() / cfg.head_dim))
    t = torch.arange(start, end, dtype=torch.int64, device=device).float()
    emb = torch.outer(t, inv).repeat(1, 2)  # [M, D]
    half = cfg.head_dim // 2
    sin = emb.sin()
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


class EagleHead(nn.Module):
    """fc (2E -> E) + n_layers decoder blocks; `bind(base)` shares the base's embedding, norm and LM head."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=cfg.fc_bias)
        if cfg.input_norms:
            self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.fnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.feature_layers:  # fused f_p = f_p + ffuse(RMS-normalised other layers), zero at first
            self.lnorms = nn.ModuleList(RMSNorm(cfg.dim, cfg.norm_eps) for _ in cfg.feature_layers)
            self.ffuse = nn.Linear(len(cfg.feature_layers) * cfg.dim, cfg.dim, bias=False)
            nn.init.zeros_(self.ffuse.weight)
        if cfg.feature_residual:  # start exactly at "f_{p+1} = f_p" through the residual path
            nn.init.zeros_(self.fc.weight)
            if self.fc.bias is not None:
                nn.init.zeros_(self.fc.bias)
        self.layers = nn.ModuleList(block_for(cfg.block_args()) for _ in range(cfg.n_layers))  # the base family's
        self._set_caches(_NoCache)
        self.max_cache = 0
        if cfg.draft_vocab_size:  # draft id -> target id; saved with the head
            self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))
        else:
            self.d2t = None
        object.__setattr__(self, "base", None)  # not a submodule: never saved, never trained
        object.__setattr__(self, "_draft_head", {})  # (base head, dtype, ...) -> LM head rows drafted over

    @torch.no_grad()
    def init_from_base(self, base: Transformer) -> "EagleHead":
        """Start the blocks from the base's last n_layers decoder layers, in order (quantized
        linears contribute their dequantized weights)."""
        for block, src in zip(self.layers, base.layers[-len(self.layers):]):
            for name, p in block.named_parameters():
                mod_name, _, attr = name.rpartition(".")
                mod = src.get_submodule(mod_name)
                w = getattr(mod, attr, None)
                if not isinstance(w, Tensor):  # a quantized linear
                    w = mod.dequantized_weight(torch.float32)
                p.copy_(w.to(p.dtype))
        return self

    def _set_caches(self, make) -> None:
        """Give every block its own cache, `make()`."""
        for block in self.layers:
            block.attention.kv_cache = make()

    def _cache_free(self) -> bool:
        return isinstance(self.layers[0].attention.kv_cache, _NoCache)

    def _blocks(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int) -> Tensor:
        for block in self.layers:
            x = block(x, cos, sin, mask, start)
        return x

    def bind(self, base: Transformer) -> "EagleHead":
        """Share `base`'s embedding, final norm and LM head, and make the base return the layers this head
        reads (Transformer.use_feature_layers): the last head bound decides, so whoever runs a head binds
        it right before (EagleLevel.start, the diagnostic, training)."""
        if base.args.dim != self.cfg.dim:
            raise ConfigError(f"drafter: head hidden size {self.cfg.dim} does not match the base model's "
                              f"hidden size {base.args.dim}; use a drafter trained on this base model")
        if base.args.vocab_size != self.cfg.vocab_size:
            raise ConfigError(f"drafter: head vocabulary {self.cfg.vocab_size} does not match the base "
                              f"model's {base.args.vocab_size}; use a drafter trained on this base model")
        base.use_feature_layers(self.cfg.feature_layers)
        object.__setattr__(self, "base", base)
        return self

    def setup_caches(self, max_seq_len: int, batch: int = 1) -> None:
        """KV cache for incremental decoding (positions 0..max_seq_len-1)."""
        p = self.fc.weight
        self._set_caches(lambda: KVCache(batch, self.cfg.n_kv_heads, max_seq_len, self.cfg.head_dim,
                                         p.dtype, p.device))
        self.max_cache = max_seq_len

    def drop_caches(self) -> None:
        """Back to cache-free full-sequence mode (training)."""
        self._set_caches(_NoCache)
        self.max_cache = 0

    def forward(self, tokens: Tensor, feats: Tensor, start: int = 0) -> Tensor:
        """tokens [B, M] (x_{p+1}), feats [B, M, E] (f_p) for rows p = start..start+M-1 -> predicted
        features [B, M, E] (f_{p+1}). Without a cache, start must be 0 (whole sequence, causal)."""
        m = tokens.shape[1]
        if self._cache_free():
            check(start == 0, "start", f"is {start} but the head has no KV cache", "call setup_caches first")
        elif start + m > self.max_cache:
            raise ConfigError(f"sequence length: {start + m} rows exceed the head's cache of {self.max_cache}; "
                              "call setup_caches with a larger max_seq_len")
        x = self._fuse(tokens, feats)  # [B, M, E]
        cos, sin = _rope(self.cfg, start, start + m, x.device, x.dtype)  # [M, 1, D]
        mask = None
        if m > 1 and start > 0:
            mask = torch.ones(m, start + m, dtype=torch.bool, device=x.device).tril(start)  # [M, start+M]
        return self._blocks(x, cos, sin, mask, start)

    def _fuse(self, tokens: Tensor, feats: Tensor) -> Tensor:
        """tokens [B, M], feats [B, M, E] (f_p, or the head's own prediction of it) or the base's
        [B, M, (n+1) E] (with feature_layers: n other layers, then f_p) -> the block's input [B, M, E]."""
        feats = self.fuse_layers(feats)  # [B, M, E]
        emb = self.base.tok_embeddings(tokens).to(feats.dtype)  # [B, M, E]
        f = feats
        if self.cfg.input_norms:
            emb, f = self.enorm(emb), self.fnorm(feats)
        x = self.fc(torch.cat((emb, f), dim=-1))  # [B, M, E]
        return x + feats if self.cfg.feature_residual else x

    def fuse_layers(self, feats: Tensor) -> Tensor:
        """[..., (n+1) E] base features (n = len(feature_layers)) -> [..., E]: f_p plus the zero-initialised
        fusion of the other layers' RMS-normalised outputs; [..., E] passes through."""
        e = self.cfg.dim
        if feats.shape[-1] == e:
            return feats
        n = len(self.cfg.feature_layers)
        check(feats.shape[-1] == (n + 1) * e, "features", f"have width {feats.shape[-1]}, the head reads "
              f"{n + 1} layers of {e}", "compute features with the base bound to this head (EagleHead.bind)")
        other = torch.cat([norm(feats[..., i * e:(i + 1) * e]) for i, norm in enumerate(self.lnorms)], dim=-1)
        return feats[..., -e:] + self.ffuse(other.to(feats.dtype))

    def unroll(self, tokens: Tensor, feats: Tensor, steps: int) -> list[Tensor]:
        """Training-time test (EAGLE-3): the head drafts `steps` tokens ahead of every position at
        once, each step reading its own previous prediction, attending exactly as at inference.

        tokens [B, T]; feats [B, T-1, E] (f_p, rows p = 0..T-2; or [B, T-1, (n+1) E], see _fuse). Step j (1-based) gives, for every
        anchor p, the predicted f_{p+j} [B, T-1, E] from the token x_{p+j} and step j-1's prediction
        (step 1: the exact f_p), at position p+j-1. Its queries see the exact rows 0..p (step 1's
        keys) and the anchor's own rows of steps 2..j, as the drafting loop's KV cache holds them.
        Rows whose x_{p+j} lies past the sequence read token 0; the caller masks them out.
        """
        check(self._cache_free(), "unroll", "needs the cache-free head", "call drop_caches first")
        b, n = tokens.shape[0], feats.shape[1]
        dev = feats.device
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # step 1: rows 0..p
        own = torch.eye(n, dtype=torch.bool, device=dev)  # steps >= 2: the anchor's own row
        self._set_caches(_StepCache)
        outs, f = [], feats
        try:
            for j in range(1, steps + 1):
                toks = tokens[:, j:j + n]  # [B, <=n] x_{p+j}
                toks = torch.cat((toks, toks.new_zeros(b, n - toks.shape[1])), dim=1)  # [B, n]
                x = self._fuse(toks, f)  # [B, n, E]
                cos, sin = _rope(self.cfg, j - 1, j - 1 + n, dev, x.dtype)  # positions p+j-1
                mask = torch.cat([causal] + [own] * (j - 1), dim=1)  # [n, j*n]
                f = self._blocks(x, cos, sin, mask, 0)
                outs.append(f)
        finally:
            self._set_caches(_NoCache)
        return outs

    def set_draft_vocab(self, ids: Tensor) -> None:
        """ids [N]: the target token ids the head drafts over (see `frequent_tokens`)."""
        check(self.d2t is not None and ids.shape == self.d2t.shape, "draft vocabulary",
              f"needs {self.cfg.draft_vocab_size} ids, got {tuple(ids.shape)}", "match draft_vocab_size")
        check(ids.unique().numel() == ids.numel(), "draft vocabulary", "has duplicate ids", "pass distinct ids")
        self.d2t.copy_(ids)

    def logits(self, hidden: Tensor) -> Tensor:
        """Predicted features [..., E] (or base features [..., (n+1) E], of which the last layer counts) ->
        logits [..., N] through the base's frozen norm and LM head (N = V, or the draft vocabulary's rows)."""
        h = self.base.norm(hidden[..., -self.cfg.dim:])
        out = self.base.output
        plain = isinstance(getattr(out, "weight", None), Tensor)  # not a quantized linear
        if self.d2t is None and plain and out.weight.dtype == h.dtype:
            return out(h)
        key = (id(out), h.dtype, h.device, None if self.d2t is None else (self.d2t.data_ptr(), self.d2t._version))
        if key not in self._draft_head:  # build the rows once per dtype, not per call
            w = out.weight if plain else out.dequantized_weight(h.dtype)
            rows = w if self.d2t is None else w[self.d2t]  # [N, E]
            if len(self._draft_head) >= 4:
                self._draft_head.clear()
            self._draft_head[key] = rows.to(h.dtype).contiguous()
        return torch.nn.functional.linear(h, self._draft_head[key])

    def to_full(self, probs: Tensor) -> Tensor:
        """Draft-vocabulary probabilities [..., N] -> full-vocabulary [..., V] (zero elsewhere)."""
        if self.d2t is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.cfg.vocab_size)
        return full.index_copy_(-1, self.d2t, probs)


def frequent_tokens(samples, n: int, vocab_size: int) -> Tensor:
    """The n most frequent answer tokens of self-distilled samples [n] (ties and the remainder by id)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.n_prompt:], dtype=torch.long), minlength=vocab_size)
    order = torch.argsort(-counts * vocab_size + torch.arange(vocab_size))  # stable: by count desc, id asc
    return order[:n].sort().values


def save_head(path: str | Path, head: EagleHead, extra: dict | None = None) -> None:
    """Head weights as safetensors, written atomically; DrafterConfig JSON (and `extra` strings) in
    the metadata."""
    sd = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    meta = {"drafter_config": json.dumps(head.cfg.to_dict()), "format": "polybasic-eagle-head"}
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    save_safetensors(path, sd, meta)


def load_head(path: str | Path, base: Transformer | None = None) -> EagleHead:
    """Load a head saved by `save_head`; bound to `base` (hidden sizes are checked) when given."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"drafter: checkpoint {p} does not exist; pass the path of a head.safetensors")
    meta = safetensors_metadata(p, FIX_HEAD)  # a damaged or truncated file: CorruptFileError
    if "drafter_config" not in meta:
        raise ConfigError(f"drafter: {p} has no drafter_config metadata; it is not a polybasic drafter head")
    cfg = DrafterConfig.from_dict(json.loads(meta["drafter_config"]))
    with torch.device("meta"):
        head = EagleHead(cfg)
    try:
        stored = load_file(str(p))
    except SafetensorError as e:
        raise corrupt_safetensors(p, FIX_HEAD, e) from None
    sd = {("layers.0." + k.removeprefix("layer.") if k.startswith("layer.") else k): v  # heads saved before n_layers
          for k, v in stored.items()}
    head.load_state_dict(sd, strict=True, assign=True)
    head.drop_caches()
    if base is not None:
        head.bind(base).to(dtype=base.dtype, device=base.device)
    return head.eval().requires_grad_(False)
