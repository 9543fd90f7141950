"""The pieces of a decoder block (gpt-fast style): a preallocated, rollback-able KV cache, rotary
embeddings, RMSNorm, attention, the gated MLP, and the Llama block that the Llama and Qwen2 families
share (models.families picks the block per family; models.decoder stacks them).

Shapes: B batch, M tokens in this call, S cache length, H heads, G kv heads, D head dim, E model dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polybasic.models import bf16_rows
from polybasic.models.args import ModelArgs
from polybasic.models.gguf_codes import ROW_INVARIANT_DTYPES, project


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

    def update(self, start: int | Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, G, M, D] at rows start..start+M-1; return the valid prefix [B, G, start+M, D].
        start a tensor of positions [M] (a static step): write there; return the whole cache [B, G, S, D]."""
        if isinstance(start, Tensor):
            return self.k.index_copy_(2, start, k), self.v.index_copy_(2, start, v)
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
        self.row_norm = False  # bf16 rows on the CPU run bf16_rows.norm (set by bf16_rows.bind)

    def forward(self, x: Tensor) -> Tensor:
        if (self.row_norm and x.dtype == self.weight.dtype == torch.bfloat16 and x.device.type == "cpu"
                and not (x.requires_grad or self.weight.requires_grad)):  # the kernel has no backward
            return bf16_rows.norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one fused op, same bits
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int | None = None) -> None:
        """in_dim: the width of the rows q, k and v are projected from (default args.dim; an EAGLE-3 head's
        layer reads [embedding; hidden], 2 * dim)."""
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(in_dim or args.dim, qkv_out, bias=args.qkv_bias)  # [q; k; v] rows
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.row_attention = False  # bf16 rows on the CPU run bf16_rows.attend (set by bf16_rows.bind)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int | Tensor,
                tree: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """x [B, M, E]; cos, sin [M, 1, D] with sin sign-folded; mask [M, start+M] or [B, 1, M, start+M], or None for
        M=1 (sees everything) and for a prefill from 0 (plain causal).
        Static step (models.static): start is the rows' slots [M] and mask [M, S] says which of the
        cache's S rows each may see; every shape is then fixed by M and S alone.
        tree: a token tree's rows (models.tree): their logical positions [M] and ancestor map [M, T]; the rows are
        written at their slots (start...), mask is the tree's (tree.visible)."""
        bsz, m, _ = x.shape
        h, g = self.n_heads, self.n_kv
        qkv = project(self.wqkv, x).view(bsz, m, h + 2 * g, self.head_dim)  # [B, M, H+2G, D]
        qk = apply_rope(qkv[:, :, :h + g], cos, sin, sin_signed=True)  # [B, M, H+G, D], q and k at once
        q = qk[:, :, :h].transpose(1, 2)  # [B, H, M, D]
        k, v = self.kv_cache.update(start, qk[:, :, h:].transpose(1, 2),
                                    qkv[:, :, h + g:].transpose(1, 2))  # [B, G, start+M, D] (static: [B, G, S, D])
        if (self.row_attention and bsz == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu"
                and (mask is None or mask.dim() == 2) and k.stride() == v.stride()):
            # a static step (mask = the rows up to each position), a one-token step, a verification or a
            # prefill (mask None or the causal slice): each row alone over the keys up to its position, whatever
            # M is, so a prompt's rows get the same bits in one call, in chunks or compiled (and sooner than
            # SDPA's: 0.25 against 0.45 s for a 671-token prompt of Qwen2.5-1.5B, AMD EPYC, 2 cores)
            pos = start if isinstance(start, Tensor) else torch.arange(start, start + m, device=q.device)  # [M]
            y = bf16_rows.attend(q, k, v, pos) if tree is None else bf16_rows.attend(q, k, v, *tree)  # [1, H, M, D]
        elif isinstance(start, Tensor):
            y = masked_attention(q, k, v, mask)  # [B, H, M, D]
        elif m == 1 and (mask is None or mask.dim() == 4):  # one row: no mask, or a batch's key mask [B, 1, 1, S]
            y = self._attend_one(q, k, v, mask)  # [B, H, 1, D]
        elif (start > 0 and bsz == 1 and (mask is None or mask.dim() == 2)
              and q.dtype in ROW_INVARIANT_DTYPES and q.device.type == "cpu"):
            # k-token verification in bf16/fp16: each row exactly as a one-token step computes it (its
            # own key length, the same call), because SDPA's bits for a row change with the row count
            # and bf16 rounds those into different logits (see gguf_codes.project for the linears); a tree's
            # row reads its own keys (the prefix, its ancestors) gathered in logical order
            if tree is None:  # row i's keys: the first start + i + 1 (views, no copy)
                keys = [(k[:, :, :start + i + 1], v[:, :, :start + i + 1]) for i in range(m)]
            else:
                keys = [(k.index_select(2, s), v.index_select(2, s))
                        for s in (_slots(p, a) for p, a in zip(tree[0].tolist(), tree[1]))]
            y = torch.cat([self._attend_one(q[:, :, i:i + 1], ki, vi) for i, (ki, vi) in enumerate(keys)],
                          dim=2)  # [B, H, M, D]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=m > 1 and mask is None,
                                               enable_gqa=h != g)  # [B, H, M, D]
        return project(self.wo, y.reshape(bsz, h, m, self.head_dim).transpose(1, 2).reshape(bsz, m, h * self.head_dim))

    def _attend_one(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """One query row per sequence, q [B, H, 1, D], over the cached rows k, v [B, G, L, D] that `mask`
        [B, 1, 1, L] (left-padded batches; None: all) lets it see -> [B, H, 1, D]."""
        bsz, h, g = q.shape[0], self.n_heads, self.n_kv
        if h == g:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if mask is not None:  # a batch's key mask (batched generation): plain math, softmax in fp32;
            # 2x faster than SDPA with a mask in bf16 on CPU, ~10x faster than SDPA's GQA path
            return masked_attention(q, k, v, mask.unsqueeze(2))  # mask [B, 1, 1, 1, L]
        # a kv head's H/G query heads are rows of one call, so K/V are not repeated per query head
        y = F.scaled_dot_product_attention(q.reshape(bsz, g, h // g, self.head_dim), k, v)  # [B, G, H/G, D]
        return y.reshape(bsz, h, 1, self.head_dim)


def _slots(pos: int, anc: Tensor) -> Tensor:
    """A tree row's key slots in logical order, positions 0..pos (anc [T]: models.tree.layout's map) -> [pos+1]."""
    lo = pos - anc.shape[0] + 1
    return torch.cat((torch.arange(max(lo, 0), device=anc.device), anc[max(-lo, 0):]))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, H, M, D] over k, v [B, G, S, D], row i seeing the keys where mask [M, S] is True -> [B, H, M, D].
    (Any mask that broadcasts to [B, 1, 1, M, S] works, e.g. a batch's key mask [B, 1, 1, 1, S].)

    Plain math with the softmax in fp32, which inductor fuses: a kv head's H/G query heads are rows of
    one product, so K and V are never repeated per query head.
    """
    bsz, h, m, d = q.shape
    g = k.shape[1]
    qg = q.reshape(bsz, g, (h // g) * m, d)  # [B, G, H/G*M, D]: head-major, as q's heads are ordered
    scores = (qg @ k.transpose(-1, -2)).float().mul_(d ** -0.5)  # [B, G, H/G*M, S]
    scores = scores.view(bsz, g, h // g, m, -1).masked_fill(~mask, float("-inf"))  # [B, G, H/G, M, S]
    y = scores.softmax(-1).to(v.dtype).view(bsz, g, (h // g) * m, -1) @ v  # [B, G, H/G*M, D]
    return y.view(bsz, h, m, d)


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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, start: int | Tensor,
                tree: tuple[Tensor, Tensor] | None = None) -> Tensor:
        h = self.attention(self.attention_norm(x), cos, sin, mask, start, tree).add_(x)
        return self.feed_forward(self.ffn_norm(h)).add_(h)
