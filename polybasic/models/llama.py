"""Lean decoder (gpt-fast style) with a preallocated, rollback-able KV cache, and the Llama block
that the Llama and Qwen2 families share (models.families picks the block per family).

The model is stateless about *where* the sequence ends: every call names the absolute position of
its first token (`start`). Rolling back to an accepted length L is therefore free: the next call
uses start=L, overwrites the stale cache rows and never attends past start+M.

Shapes: B batch, M tokens in this call, S cache length, H heads, G kv heads, D head dim, E model dim.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polybasic.errors import ConfigError
from polybasic.models.args import ModelArgs
from polybasic.models.gguf_codes import ROW_INVARIANT_DTYPES, attach_codes, project


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def keep(self, rows: Tensor) -> None:
        """Keep only the sequences `rows` [B'] of the batch, in that order (a batch whose other rows finished)."""
        self.k, self.v = self.k.index_select(0, rows), self.v.index_select(0, rows)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, G, M, D] at rows start..start+M-1; return the valid prefix [B, G, start+M, D]."""
        m = k.shape[2]
        self.k.narrow(2, start, m).copy_(k)
        self.v.narrow(2, start, m).copy_(v)
        return self.k.narrow(2, 0, start + m), self.v.narrow(2, 0, start + m)


class NoCache(nn.Module):
    """Stand-in for KVCache when a block sees a whole sequence from position 0 (calibration)."""

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return k, v


def rope_tables(args: ModelArgs, max_seq_len: int, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin [max_seq_len, D] in fp32, HF 'rotate_half' layout."""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64,
                                                       device=device).float() / args.head_dim))
    t = torch.arange(max_seq_len, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)  # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, sin_signed: bool = False) -> Tensor:
    """x [B, H, M, D]; cos, sin [M, D] (or any shapes broadcasting against x over the last dim D).

    sin_signed: `sin` already has its first half negated (see `Transformer.setup_caches`), which
    turns rotate-half into a plain roll; the result is bit-identical to the HF formula.
    """
    half = x.shape[-1] // 2
    if not sin_signed:
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return x * cos + x.roll(half, -1) * sin  # roll: [x2, x1]; times [-s, s] = rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, same bits
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=args.qkv_bias)  # [q; k; v] rows
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int) -> Tensor:
        """x [B, M, E]; cos, sin [M, 1, D] with sin sign-folded; mask [M, start+M] or [B, 1, M, start+M], or None for
        M=1 (sees everything) and for a prefill from 0 (plain causal)."""
        bsz, m, _ = x.shape
        h, g = self.n_heads, self.n_kv
        qkv = project(self.wqkv, x).view(bsz, m, h + 2 * g, self.head_dim)  # [B, M, H+2G, D]
        qk = apply_rope(qkv[:, :, :h + g], cos, sin, sin_signed=True)  # [B, M, H+G, D], q and k at once
        q = qk[:, :, :h].transpose(1, 2)  # [B, H, M, D]
        k, v = self.kv_cache.update(start, qk[:, :, h:].transpose(1, 2),
                                    qkv[:, :, h + g:].transpose(1, 2))  # [B, G, start+M, D]
        compiling = torch.compiler.is_compiling()
        if m == 1 and (mask is None or mask.dim() == 4):  # one row: no mask, or a batch's key mask [B, 1, 1, S]
            y = self._attend_one(q, k, v, compiling, mask)  # [B, H, 1, D]
        elif (start > 0 and bsz == 1 and not compiling and (mask is None or mask.dim() == 2)
              and q.dtype in ROW_INVARIANT_DTYPES and q.device.type == "cpu"):
            # k-token verification in bf16/fp16: each row exactly as a one-token step computes it (its
            # own key length, the same call), because SDPA's bits for a row change with the row count
            # and bf16 rounds those into different logits (see gguf_codes.project for the linears)
            y = torch.cat([self._attend_one(q[:, :, i:i + 1], k[:, :, :start + i + 1], v[:, :, :start + i + 1],
                                            compiling) for i in range(m)], dim=2)  # [B, H, M, D]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=m > 1 and mask is None,
                                               enable_gqa=h != g)  # [B, H, M, D]
        return project(self.wo, y.reshape(bsz, h, m, self.head_dim).transpose(1, 2).reshape(bsz, m, h * self.head_dim))


    def _attend_one(self, q: Tensor, k: Tensor, v: Tensor, compiling: bool, mask: Tensor | None = None) -> Tensor:
        """One query row per sequence, q [B, H, 1, D], over the cached rows k, v [B, G, L, D] that `mask`
        [B, 1, 1, L] (left-padded batches; None: all) lets it see -> [B, H, 1, D]."""
        bsz, h, g = q.shape[0], self.n_heads, self.n_kv
        if h == g and not compiling:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        # a kv head's H/G query heads are rows of one call, so K/V are not repeated per query head
        qg = q.reshape(bsz, g, h // g, self.head_dim)  # [B, G, H/G, D]
        if compiling and mask is None:  # plain math: inductor maps it back to one SDPA call with fewer
            # layout copies (22.2 vs 22.6-23.5 ms per compiled step)
            y = ((qg @ k.transpose(-1, -2)) * self.head_dim ** -0.5).softmax(-1) @ v  # [B, G, H/G, D]
        elif mask is not None:  # a batch's key mask (batched generation): plain math, softmax in fp32;
            # 2x faster than SDPA with a mask in bf16 on CPU, ~10x faster than SDPA's GQA path
            scores = (qg @ k.transpose(-1, -2)).float() * self.head_dim ** -0.5  # [B, G, H/G, L]
            y = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype) @ v  # [B, G, H/G, D]
        else:
            y = F.scaled_dot_product_attention(qg, k, v)  # [B, G, H/G, D]
        return y.reshape(bsz, h, 1, self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # [gate; up]
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(self.w13, x).chunk(2, dim=-1)  # [B, M, I] each
        return project(self.w2, F.silu(gate).mul_(up))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int) -> Tensor:
        h = self.attention(self.attention_norm(x), cos, sin, mask, start).add_(x)
        return self.feed_forward(self.ffn_norm(h)).add_(h)


class Transformer(nn.Module):
    """Decoder-only LM. Call `setup_caches` once before `forward`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        from polybasic.models.families import block_for

        self.layers = nn.ModuleList(block_for(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.max_seq_len = 0
        self._compiled_step = None  # see compile_decode
        self.feature_layers: tuple[int, ...] = ()  # see use_feature_layers

    def tie_weights(self) -> None:
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def setup_caches(self, max_seq_len: int, batch: int = 1) -> None:
        """Allocate KV caches and RoPE tables for sequences of up to max_seq_len tokens."""
        if max_seq_len > self.args.max_seq_len:
            raise ConfigError(f"max_seq_len: {max_seq_len} exceeds the model's context window of "
                              f"{self.args.max_seq_len} tokens; shorten the prompt or max_new_tokens")
        if max_seq_len <= self.max_seq_len and self.layers[0].attention.kv_cache.k.shape[0] == batch:
            return
        if self._compiled_step is not None:  # dynamo specialises on buffer sizes: few sizes, few compiles
            max_seq_len = min(self.args.max_seq_len, max(256, 1 << (max_seq_len - 1).bit_length()))
        dev, dt = self.device, self.dtype
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, self.args.n_kv_heads, max_seq_len,
                                               self.args.head_dim, dt, dev)
        cos, sin = rope_tables(self.args, max_seq_len, dev)  # [S, D]
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # sign-folded, see apply_rope
        self.register_buffer("rope_cos", cos.to(dt).unsqueeze(1), persistent=False)  # [S, 1, D]
        self.register_buffer("rope_sin", sin.to(dt).unsqueeze(1), persistent=False)  # [S, 1, D]
        causal = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=dev).tril()
        self.register_buffer("causal_mask", causal, persistent=False)
        self.max_seq_len = max_seq_len

    def use_feature_layers(self, layers) -> None:
        """From now on `forward` also returns the outputs of these decoder layers (0-based, each below
        the last), in front of the last layer's hidden state: features [..., (len(layers)+1) * E], what a
        drafter head reading several layers (EAGLE-3) needs. () restores the last layer alone."""
        n = self.args.n_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < n - 1 for i in layers):
            raise ConfigError(f"feature_layers: {list(layers)} must be distinct increasing layer indices in "
                              f"[0, {n - 2}] for this {n}-layer model (the last layer, {n - 1}, is always read); "
                              "fix distill.feature_layers")
        self.feature_layers = tuple(layers)

    def keep_rows(self, rows: Tensor) -> None:
        """Shrink the KV caches to the batch rows `rows` [B'] (the next calls pass B' sequences)."""
        for layer in self.layers:
            layer.attention.kv_cache.keep(rows)

    def compile_decode(self, gguf: str | Path | None = None, options: dict | None = None) -> int:
        """Run one-token steps (M=1, no key mask) through `torch.compile` from now on.

        The step is compiled with a symbolic `start` (dynamic=True) on its first call: tens of seconds
        on a CPU, then cached by inductor on disk. Dynamo specialises on the cache length, so from now
        on `setup_caches` rounds it up to a power of two (>= 256): a new size costs one more compile,
        which a server avoids by sizing the caches for its longest request up front (polybasic bench
        does). Prefills and k-token verifications stay eager. Logits agree with the eager step to
        float rounding (fused kernels sum in another order), not bit for bit.

        gguf: the GGUF file the fp32 weights were expanded from. Its block codes are attached to the
        CPU fp32 linears they reproduce exactly (see gguf_codes), and compiled steps read those, 1 byte
        per weight instead of 4 (+~1.2 bytes per weight of memory). Returns how many linears read codes.
        options: inductor options (models.prepare.compile_for_device passes the device's).
        """
        coded = attach_codes(self, gguf) if gguf is not None else 0
        if self._compiled_step is None:
            self._compiled_step = torch.compile(self._forward, dynamic=True, options=options)
        return coded

    def forward(self, tokens: Tensor, start: int, last_only: bool = False,
                key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """tokens [B, M] at positions start..start+M-1.

        key_mask [B, S'] (S' >= start+M, bool): cache rows each sequence may attend to, for
        left-padded batches (False on the padding). RoPE is relative, so a row padded by n slots
        scores exactly as if it started at slot 0.

        Returns logits [B, M, V] (or [B, 1, V] with last_only) and the last layer's hidden states
        before the final norm, [B, M, E] (the features EAGLE-style drafters read); with
        `use_feature_layers`, the outputs of those layers in front of it, [B, M, (n+1) * E].
        """
        m = tokens.shape[1]
        end = start + m
        if end > self.max_seq_len:
            raise ConfigError(f"sequence length: {end} tokens exceed the cache of {self.max_seq_len}; "
                              "call setup_caches with a larger max_seq_len")
        if self._compiled_step is not None and m == 1 and key_mask is None:
            return self._compiled_step(tokens, start, last_only)
        return self._forward(tokens, start, last_only, key_mask)

    def _forward(self, tokens: Tensor, start: int, last_only: bool = False,
                 key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        m = tokens.shape[1]
        end = start + m
        cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]  # [M, 1, D]
        mask = None if m == 1 or start == 0 else self.causal_mask[start:end, :end]  # [M, start+M]
        if key_mask is not None:
            keys = key_mask[:, None, None, :end]  # [B, 1, 1, start+M]
            mask = keys & self.causal_mask[start:end, :end] if m > 1 else keys  # [B, 1, M, start+M]
        x = self.tok_embeddings(tokens)  # [B, M, E]
        taken = []  # outputs of self.feature_layers, each [B, M, E]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, start)
            if i in self.feature_layers:
                taken.append(x)
        hidden = torch.cat(taken + [x], dim=-1) if taken else x  # [B, M, (n+1) E]
        if last_only:
            x = x[:, -1:]
        return project(self.output, self.norm(x)), hidden


def hf_to_lean_state_dict(sd: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Map a transformers state dict onto ours, through args.family's mapping."""
    from polybasic.models.families import family_for

    return family_for(args.family).hf_to_lean(sd, args)


def build_model(args: ModelArgs, state_dict: dict[str, Tensor], dtype: torch.dtype = torch.float32,
                device: str | torch.device | None = None) -> Transformer:
    """Build on the meta device, then assign the weights (no double allocation) on `device` (default:
    where the state dict's tensors are)."""
    with torch.device("meta"):
        model = Transformer(args)
    sd = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if args.tie_embeddings:
        sd.pop("output.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_embeddings and k == "output.weight")]
    if missing or unexpected:
        raise ConfigError(f"state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                          "the weights do not match the model args")
    model.tie_weights()
    return model.eval().requires_grad_(False)


def use_decode_layout(model: nn.Module) -> nn.Module:
    """Give every nn.Linear weight [out, in] the faster memory layout for its dtype and device.

    fp32 on CPU: a transposed view of a contiguous [in, out] buffer, so F.linear runs the
    "x @ W^T-contiguous" GEMM (measured, all of SmolLM2-135M's matmuls at M=1: 16.7 vs 19.2 ms; no
    slower for prefills of 200-1300 tokens). Anything else (e.g. bf16, slower transposed at every M,
    or a bf16 copy made from a transposed fp32 model): plain contiguous [out, in].
    Values and shapes are unchanged. A tied embedding shares the new buffer (in the transposed
    layout a strided row gather: ~12 ms for a 1300-token prefill).
    """
    new: dict[int, nn.Parameter] = {}  # id(old weight) -> its replacement, so ties survive
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(mod, nn.Linear) or id(w) in new:
            continue
        transposed = w.device.type == "cpu" and w.dtype == torch.float32
        if transposed and w.is_contiguous():
            new[id(w)] = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)
        elif not transposed and not w.is_contiguous():
            new[id(w)] = nn.Parameter(w.detach().contiguous(), requires_grad=False)
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) and id(getattr(mod, "weight", None)) in new:
            mod.weight = new[id(mod.weight)]
    return model
