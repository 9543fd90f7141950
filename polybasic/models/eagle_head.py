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

`DrafterConfig.arch = "eagle3"` selects `Eagle3Head` instead: the function vLLM's eagle3 drafter
computes (vllm/model_executor/models/llama_eagle3.py, vLLM 0.32), so a head exported in the
speculators format (models.speculators_format) drafts the same tokens there as here:
- hidden h_p = fc([a_1; ...; a_n]) (nE -> E, no bias) over the outputs of the base layers
  `feature_layers` at position p (vLLM's aux hidden state of layer id i is the INPUT of decoder
  layer i, i.e. our layer i-1's output: eagle_aux_hidden_state_layer_ids = feature_layers + 1);
- one decoder layer at position p: attention over [input_layernorm(emb(x_{p+1})); hidden_norm(h_p)]
  (q/k/v read 2E), residual h_p (norm_before_residual false), post-attention norm, gated MLP;
  its output o_p (before any norm) is what the next draft step reads as its h (no fc);
- logits over the draft vocabulary: lm_head(norm(o_p)), its own norm and LM head (started from the
  base's final norm and its LM head's rows d2t; the LM head stays frozen, as speculators trains it);
  the base's embedding is shared. Trained by the token loss alone (train.regress: none).

Shapes: B batch, M rows in this call, E model dim, V vocabulary.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn

from polybasic.artifacts import save_safetensors
from polybasic.config import HEAD_ARCHS, check_feature_layers
from polybasic.errors import ConfigError, check
from polybasic.models.args import BlockShape, ModelArgs
from polybasic.models.blocks import Attention, FeedForward, KVCache, RMSNorm
from polybasic.models.decoder import Transformer
from polybasic.models.families import block_for
from polybasic.models.preflight import FIX_HEAD, corrupt_safetensors, safetensors_metadata
from polybasic.models.static import StaticSteps, pad_rows

DRAFTER_VERSION = 2
ARCHS = HEAD_ARCHS  # eagle1: EagleHead, eagle3: Eagle3Head
_EAGLE1_ONLY = {"fc_bias": True, "input_norms": True, "feature_residual": True}  # fields eagle3 heads keep at these


def eagle3_layers(n_layers: int) -> list[int]:
    """The base layers an EAGLE-3 head reads by default: vLLM's aux hidden state layer ids for llama,
    (2, n//2, n-3), as the 0-based layers whose outputs they are (id i is layer i-1's output)."""
    layers = [2 - 1, n_layers // 2 - 1, n_layers - 3 - 1]
    check(layers == sorted(set(layers)) and layers[0] >= 0 and layers[-1] <= n_layers - 2,
          "distill.feature_layers", f"vLLM's default EAGLE-3 layers {layers} do not fit a {n_layers}-layer model",
          "name the layers the head reads, e.g. [0] (0-based decoder layers below the last)")
    return layers


@dataclass(kw_only=True)
class DrafterConfig(BlockShape):
    """The head's architecture (its block is shaped like one of the base's); saved as JSON in the
    checkpoint's metadata."""

    arch: str = "eagle1"  # eagle1: EagleHead (this module's docstring); eagle3: Eagle3Head (vLLM's eagle3)
    n_layers: int = 1  # decoder blocks (EAGLE uses one; small bases may need more)
    fc_bias: bool = True
    draft_vocab_size: int = 0  # > 0: draft over the N most frequent target tokens only (EAGLE-3)
    input_norms: bool = True  # RMSNorm the embedding and the feature before the fuse layer
    feature_residual: bool = True  # the block's input is f_p + fc(...), not fc(...) alone
    feature_layers: list[int] = field(default_factory=list)  # also read these base layers' outputs
    # (eagle3: the layers fc fuses, default eagle3_layers)
    version: int = DRAFTER_VERSION

    def __post_init__(self) -> None:
        self.check_shape("DrafterConfig", "fix the drafter config")
        check(self.arch in ARCHS, "DrafterConfig.arch", f"is {self.arch!r}", f"use one of {', '.join(ARCHS)}")
        if self.arch == "eagle3":
            check(self.n_layers == 1, "DrafterConfig.n_layers", f"is {self.n_layers}; an eagle3 head has one "
                  "decoder layer (vLLM's eagle3 drafter)", "use 1 (distill.head_layers: 1)")
            check(bool(self.feature_layers), "DrafterConfig.feature_layers", "is empty; an eagle3 head fuses "
                  "base layers", "build the config with DrafterConfig.for_base (default: eagle3_layers)")
            for name, default in _EAGLE1_ONLY.items():
                check(getattr(self, name) == default, f"DrafterConfig.{name}", "is an eagle1 option",
                      f"leave it at {default} for an eagle3 head")
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
        """A head matching a base model (its decoder block is shaped like one of the base's; an eagle3
        head without feature_layers reads eagle3_layers)."""
        if overrides.get("arch") == "eagle3" and not overrides.get("feature_layers"):
            overrides["feature_layers"] = eagle3_layers(args.n_layers)
        return cls(**{**args.shape(), **overrides})

    def block_args(self) -> ModelArgs:
        return ModelArgs(n_layers=1, **self.shape())

    def to_dict(self) -> dict:
        """The fields; `arch` only when not eagle1, so an eagle1 head's metadata is what it was before
        the field (older polybasic reads it)."""
        d = asdict(self)
        if d["arch"] == "eagle1":
            del d["arch"]
        return d

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
    """fc (2E -> E) + n_layers decoder blocks; `bind(base)` shares the base's embedding, norm and LM head.
    Build heads with `make_head(cfg)` (it picks Eagle3Head for arch eagle3)."""

    ARCH = "eagle1"

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        check(cfg.arch == self.ARCH, "DrafterConfig.arch", f"is {cfg.arch!r} but {type(self).__name__} is "
              f"{self.ARCH}", "build the head with make_head(cfg)")
        self.cfg = cfg
        self._build(cfg)
        self._set_caches(_NoCache)
        self.max_cache = 0
        if cfg.draft_vocab_size:  # draft id -> target id; saved with the head
            self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size))
        else:
            self.d2t = None
        object.__setattr__(self, "base", None)  # not a submodule: never saved, never trained
        object.__setattr__(self, "_draft_head", {})  # (base head, dtype, ...) -> LM head rows drafted over
        object.__setattr__(self, "_rows", None)  # (id of the base's LM head, a module for its draft rows), see use_rows
        object.__setattr__(self, "_static", None)  # compiled steps, see compile_steps

    def _build(self, cfg: DrafterConfig) -> None:
        """The trained modules: fc, the blocks (and the optional norms and layer fusion)."""
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

    @torch.no_grad()
    def init_from_base(self, base: Transformer) -> "EagleHead":
        """Start the blocks from the base's last n_layers decoder layers, in order (quantized
        linears contribute their dequantized weights)."""
        for block, src in zip(self.layers, base.layers[-len(self.layers):]):
            for name, p in block.named_parameters():
                p.copy_(_base_param(src, name).to(p.dtype))
        return self

    def init_output_from_base(self, base: Transformer) -> "EagleHead":
        """Start the head's own output layers from the base's (an eagle1 head has none: it uses the base's)."""
        return self

    def _set_caches(self, make) -> None:
        """Give every block its own cache, `make()`."""
        if getattr(self, "_static", None) is not None:
            self._static.forget()  # its straight calls hold the caches replaced here
        for block in self.layers:
            block.attention.kv_cache = make()

    def _cache_free(self) -> bool:
        return isinstance(self.layers[0].attention.kv_cache, _NoCache)

    def _blocks(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int) -> Tensor:
        for block in self.layers:
            x = block(x, cos, sin, mask, start)
        return x

    def _step(self, tokens: Tensor, feats: Tensor, pos: int | Tensor, mask: Tensor | None,
              start: int | Tensor) -> Tensor:
        """One pass of the head's rows at positions pos..pos+M-1 (or the positions tensor pos [M], a static
        step), writing cache rows start..: tokens [B, M], feats [B, M, E] or [B, M, (n+1) E] (see _fuse)
        -> outputs [B, M, E]."""
        x = self._fuse(tokens, feats)  # [B, M, E]
        return self._blocks(x, *self._rope_at(pos, x), mask, start)

    def _rope_at(self, pos: int | Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [M, 1, D] for x's M rows at positions pos.. (int: computed in x's dtype) or pos [M]
        (a static step: rows of the tables setup_caches made)."""
        if isinstance(pos, Tensor):
            return self.rope_cos[pos], self.rope_sin[pos]
        return _rope(self.cfg, pos, pos + x.shape[1], x.device, x.dtype)

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
        if getattr(self, "base", None) is not base and getattr(self, "_static", None) is not None:
            self._static.forget()  # its straight calls hold the base's tensors the head reads
        object.__setattr__(self, "base", base)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the head's activations and caches: its norms' (fc and the blocks' linears may run on 4-bit
        kernels, quant.quantize_head)."""
        return self._norm_weight().dtype

    @property
    def device(self) -> torch.device:
        return self._norm_weight().device

    def _norm_weight(self) -> Tensor:
        return next(m.weight for m in self.layers.modules() if isinstance(m, RMSNorm))  # never quantized

    def setup_caches(self, max_seq_len: int, batch: int = 1) -> None:
        """KV cache for incremental decoding (positions 0..max_seq_len-1); with compiled steps a power of
        two (>= 256) rows, plus the padding rows of the largest step, and their RoPE tables and mask."""
        rows = max_seq_len
        if self._static is not None:
            max_seq_len, rows = self._static.cache_rows(max_seq_len)
            kv = self.layers[0].attention.kv_cache
            if max_seq_len <= self.max_cache and getattr(kv, "k", None) is not None and kv.k.shape[0] == batch:
                return  # the same buffers: the compiled steps keep their graphs (and CUDA graphs their addresses)
            cos, sin = _rope(self.cfg, 0, rows, self.device, self.dtype)  # [S, 1, D]
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
            self.register_buffer("causal_mask", torch.ones(rows, rows, dtype=torch.bool, device=self.device).tril(),
                                 persistent=False)  # [S, S]
        self._set_caches(lambda: KVCache(batch, self.cfg.n_kv_heads, rows, self.cfg.head_dim, self.dtype, self.device))
        self.max_cache = max_seq_len

    def compile_steps(self, options: dict | None = None, sizes=None, notify=None) -> None:
        """Run the cached forwards through static-shape compiled steps (models.static), as
        Transformer.compile_steps does; call before setup_caches."""
        if self._static is None:
            object.__setattr__(self, "_static", StaticSteps(self._static_step, "the EAGLE head", sizes,
                                                            self.device, options, notify))
        elif notify is not None:
            self._static.notify = notify

    @torch.inference_mode()
    def warm_steps(self, widths: tuple[int, ...]) -> None:
        """Compile every step size now (each once per feature width in `widths`: the base's [(n+1) E],
        the head's own E), so that no compile lands inside a timed or latency-critical call. Writes
        garbage to cache rows the next generation overwrites; needs setup_caches first."""
        steps = self._static
        for _ in range(steps.warm_runs):
            for size in steps.sizes:
                for w in widths:
                    self(torch.zeros(1, size, dtype=torch.long, device=self.device),
                         torch.zeros(1, size, w, dtype=self.dtype, device=self.device), 0)

    def _static_step(self, tokens: Tensor, feats: Tensor, pos: Tensor) -> Tensor:
        return self._step(tokens, feats, pos, self.causal_mask[pos], pos)

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
        if self._static is not None and not self._cache_free():
            return self._static_forward(tokens, feats, start)
        mask = None
        if m > 1 and start > 0:
            mask = torch.ones(m, start + m, dtype=torch.bool, device=feats.device).tril(start)  # [M, start+M]
        return self._step(tokens, feats, start, mask, start)

    def _static_forward(self, tokens: Tensor, feats: Tensor, start: int) -> Tensor:
        """forward through the compiled steps: chunks of the largest size, the last one padded."""
        steps, out = self._static, []
        for a, n, size, pos in steps.chunks(tokens.shape[1], start, tokens.device):
            key = (tokens.shape[0], size, feats.shape[-1], self.max_cache)  # the caches only grow: a new graph
            out.append(steps(key, pad_rows(tokens[:, a:a + n], size), pad_rows(feats[:, a:a + n], size), pos)[:, :n])
        return out[0] if len(out) == 1 else torch.cat(out, 1)  # [B, M, E]

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
        n = self._check_width(feats)
        other = torch.cat([norm(feats[..., i * e:(i + 1) * e]) for i, norm in enumerate(self.lnorms)], dim=-1)
        return feats[..., -e:] + self.ffuse(other.to(feats.dtype))

    def _check_width(self, feats: Tensor) -> int:
        """n = len(feature_layers), once base features [..., (n+1) E] are checked to be that wide."""
        e, n = self.cfg.dim, len(self.cfg.feature_layers)
        check(feats.shape[-1] == (n + 1) * e, "features", f"have width {feats.shape[-1]}, the head reads "
              f"{n + 1} layers of {e}", "compute features with the base bound to this head (EagleHead.bind)")
        return n

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
                mask = torch.cat([causal] + [own] * (j - 1), dim=1)  # [n, j*n]
                f = self._step(toks, f, j - 1, mask, 0)  # positions p+j-1
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
        object.__setattr__(self, "_rows", None)  # rows of the old vocabulary (use_rows)

    def logits(self, hidden: Tensor) -> Tensor:
        """The head's outputs [..., E] -> draft logits [..., N] (N = V, or the draft vocabulary's rows):
        here through the base's frozen norm and LM head (`base_logits`)."""
        return self.base_logits(hidden)

    def base_logits(self, hidden: Tensor) -> Tensor:
        """Features [..., E] (or base features [..., (n+1) E], of which the last layer counts) -> the base's
        logits over the draft vocabulary [..., N], through its final norm and LM head (rows d2t)."""
        h = self.base.norm(hidden[..., -self.cfg.dim:])
        out = self.base.output
        if self._rows is not None and self._rows[0] == id(out):
            return self._rows[1](h)
        if self.d2t is None and _plain(out) and out.weight.dtype == h.dtype:
            return out(h)
        key = (id(out), h.dtype, h.device, None if self.d2t is None else (self.d2t.data_ptr(), self.d2t._version))
        if key not in self._draft_head:  # build the rows once per dtype, not per call
            if len(self._draft_head) >= 4:
                self._draft_head.clear()
            self._draft_head[key] = self.draft_rows(h.dtype).to(h.device).contiguous()
        return torch.nn.functional.linear(h, self._draft_head[key])

    def use_rows(self, module: nn.Module) -> None:
        """Compute base_logits with `module` (a linear [E -> N] over the bound base's draft rows, e.g. on 4-bit
        weights: quant.quantize_head) for as long as the head stays bound to that base's LM head."""
        object.__setattr__(self, "_rows", (id(self.base.output), module))

    def rows_source(self) -> nn.Module:
        """The base module whose weight draft_rows reads: its LM head, or where that is quantized and tied, its
        embedding, which stays float (equal to the LM head's rows to rounding)."""
        out, emb = self.base.output, self.base.tok_embeddings
        return emb if not _plain(out) and self.base.args.tie_embeddings and _plain(emb) else out

    def draft_rows(self, dtype: torch.dtype) -> Tensor:
        """The base LM head's rows of the draft vocabulary [N, E] in `dtype` (a quantized head: dequantized)."""
        src = self.rows_source()
        if _plain(src):
            return (src.weight if self.d2t is None else src.weight[self.d2t]).to(dtype)
        return src.dequantized_weight(dtype, rows=self.d2t).to(dtype)  # a coded one runs the draft rows' tiles only

    def to_full(self, probs: Tensor) -> Tensor:
        """Draft-vocabulary probabilities [..., N] -> full-vocabulary [..., V] (zero elsewhere)."""
        if self.d2t is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.cfg.vocab_size)
        return full.index_copy_(-1, self.d2t, probs)


def _plain(linear) -> bool:
    """A plain nn.Linear (not a quantized linear)."""
    return isinstance(getattr(linear, "weight", None), Tensor)


def _base_param(module: nn.Module, name: str) -> Tensor:
    """module's parameter `name` (dotted); a quantized linear's weight dequantized to fp32."""
    mod_name, _, attr = name.rpartition(".")
    mod = module.get_submodule(mod_name)
    w = getattr(mod, attr, None)
    return w if isinstance(w, Tensor) else mod.dequantized_weight(torch.float32)


class Eagle3Layer(nn.Module):
    """vLLM's eagle3 decoder layer (llama_eagle3.LlamaDecoderLayer, layer 0, norm_before_residual false):
    attention over [attention_norm(emb); hidden_norm(h)], residual h, then ffn_norm and the gated MLP.
    Names: attention_norm = input_layernorm, ffn_norm = post_attention_layernorm (speculators_format)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args, in_dim=2 * args.dim)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, emb: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                start: int) -> Tensor:
        """emb, hidden [B, M, E] -> the layer's output [B, M, E] (before any norm)."""
        x = torch.cat((self.attention_norm(emb), self.hidden_norm(hidden)), dim=-1)  # [B, M, 2E]
        h = self.attention(x, cos, sin, mask, start) + hidden
        return self.feed_forward(self.ffn_norm(h)) + h


class Eagle3Head(EagleHead):
    """The EAGLE-3 head (module docstring): fc (nE -> E) over the base layers `feature_layers`, one
    Eagle3Layer, its own final norm and LM head over the draft vocabulary; the base's embedding is shared."""

    ARCH = "eagle3"

    def _build(self, cfg: DrafterConfig) -> None:
        n = len(cfg.feature_layers)
        self.fc = nn.Linear(n * cfg.dim, cfg.dim, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg.block_args())])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        self.lm_head.requires_grad_(False)  # the base's rows, frozen (init_output_from_base)

    @torch.no_grad()
    def init_from_base(self, base: Transformer) -> "Eagle3Head":
        """Start as the base layer L after the highest fused one (L's input is that layer's output): fc
        passes that layer's output on, the layer's hidden half, norms and MLP are L's, and the embedding half
        of q/k/v starts at zero. At step 1 the head then computes L's output exactly."""
        e, n = self.cfg.dim, len(self.cfg.feature_layers)
        self.fc.weight.zero_()
        self.fc.weight[:, (n - 1) * e:].copy_(torch.eye(e))
        src = base.layers[self.cfg.feature_layers[-1] + 1]
        layer = self.layers[0]
        for name, p in layer.named_parameters():
            if name == "hidden_norm.weight":
                p.copy_(_base_param(src, "attention_norm.weight").to(p.dtype))
            elif name == "attention.wqkv.weight":
                p.zero_()
                p[:, e:].copy_(_base_param(src, name).to(p.dtype))
            else:
                p.copy_(_base_param(src, name).to(p.dtype))
        layer.attention_norm.weight.fill_(1.0)
        return self

    @torch.no_grad()
    def init_output_from_base(self, base: Transformer) -> "Eagle3Head":
        """The final norm is the base's, the LM head the base's rows of the draft vocabulary (call after
        set_draft_vocab)."""
        self.bind(base)
        self.norm.weight.copy_(base.norm.weight.to(self.norm.weight.dtype))
        self.lm_head.weight.copy_(self.draft_rows(torch.float32).to(self.lm_head.weight.dtype))
        return self

    def _step(self, tokens: Tensor, feats: Tensor, pos: int | Tensor, mask: Tensor | None,
              start: int | Tensor) -> Tensor:
        """tokens [B, M]; feats: the base's [B, M, (n+1) E] (n fused layers, then the last, unread), or the
        head's own outputs [B, M, E] (later draft steps) -> outputs [B, M, E]."""
        e = self.cfg.dim
        # the fused layers' slice made contiguous: a compiled step multiplied a strided slice of 2+ rows by a copy of
        # fc's weight, made every call (14 MB on Qwen2.5-Coder-1.5B: ~6 ms a call once the target's step had
        # evicted it from the caches)
        hidden = feats if feats.shape[-1] == e else self.fc(feats[..., :self._check_width(feats) * e].contiguous())
        emb = self.base.tok_embeddings(tokens).to(hidden.dtype)  # [B, M, E]
        return self.layers[0](emb, hidden, *self._rope_at(pos, hidden), mask, start)

    def logits(self, hidden: Tensor) -> Tensor:
        """The head's outputs [..., E] -> draft logits [..., N] through its own norm and LM head."""
        return self.lm_head(self.norm(hidden))


HEADS = {cls.ARCH: cls for cls in (EagleHead, Eagle3Head)}


def make_head(cfg: DrafterConfig) -> EagleHead:
    """A new head of cfg.arch."""
    return HEADS[cfg.arch](cfg)


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
    try:
        stored = load_file(str(p))
    except SafetensorError as e:
        raise corrupt_safetensors(p, FIX_HEAD, e) from None
    sd = {("layers.0." + k.removeprefix("layer.") if k.startswith("layer.") else k): v  # heads saved before n_layers
          for k, v in stored.items()}
    return head_from_state_dict(cfg, sd, base)


def head_from_state_dict(cfg: DrafterConfig, sd: dict[str, Tensor], base: Transformer | None = None) -> EagleHead:
    """A head of `cfg` holding the tensors `sd` (every one, no copy), ready to draft: bound to `base` and
    in its dtype and device when given."""
    with torch.device("meta"):
        head = make_head(cfg)
    head.load_state_dict(sd, strict=True, assign=True)
    head.drop_caches()
    if base is not None:
        head.bind(base).to(dtype=base.dtype, device=base.device)
    return head.eval().requires_grad_(False)
