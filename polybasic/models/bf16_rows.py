"""The CPU kernel 'bf16_rows': a bf16 linear whose every output row has the same bits for any row count.

kernels/bf16_rows.cpp holds the arithmetic (see its header): AVX-512 BF16 dot products summed in a fixed
order per output, or, on CPUs without AVX-512 BF16, a portable build of the same operations in the same order
(`isa()` says which runs). It serves bf16 models on a CPU for both of their hot shapes: the one-token step, which
it runs at the memory's speed (oneDNN's GEMM reads the weights about 1.5x slower at one or two rows), and
a verification's few rows, which it runs at the CPU's bf16 FLOP rate. Being row-invariant by
construction, a target's one-token step no longer needs oneDNN's zero-row padding to match its
verifications (gguf_codes.project).

`bind(model)` marks a model's bf16 CPU linears for it, once at load time (models.prepare); `project`
then calls `linear` for them, eager or compiled (a fake implementation lets torch.compile trace the op),
for calls of up to ROWS_MAX rows. It also lets the model's attention run `attend`, the same kind of kernel
for a decoding step's or a verification's rows: each row as if alone, over the cache rows it may see only
(a static step's caches hold more rows than it reads), and its RMSNorms run `norm` (one call where eager
PyTorch runs about ten small ops, ~0.1 ms a norm on 2 cores; row-invariant too).
`status()` says once per process whether it can run here, and why not (no compiler); where it cannot, or where
$POLYBASIC_BF16_KERNEL=onednn says so (`choice()`), linears keep oneDNN and compiled steps are not row-invariant.
"""
from __future__ import annotations

import os
from functools import cache
from importlib.resources import files
from pathlib import Path

import torch
from torch import Tensor, nn

from polybasic.errors import ConfigError
from polybasic.models.native import load_ops, usable

SOURCE = files("polybasic.models") / "kernels" / "bf16_rows.cpp"
MARK = "bf16_rows"  # the attribute bind() sets on a linear
ATTEND = "row_attention"  # the attribute of an attention module that bind() sets: True runs `attend` on bf16 CPU rows
NORM = "row_norm"  # the attribute of an RMSNorm module that bind() sets: True runs `norm` on bf16 CPU rows
CHOICE_ENV = "POLYBASIC_BF16_KERNEL"
ROWS_MAX = 64  # calls of more rows (long prefills) run oneDNN, faster there: the kernel ran one model's linears at
# 0.91x / 0.74x / 0.66x oneDNN's speed at 64 / 128 / 512 rows, and at 2.25x / 1.36x / 1.16x at 1 / 4 / 17 (AMD EPYC,
# 2 cores; docs/history.md). A prefill's rows are computed alike by plain decoding and by a chain's target, and a
# verification of up to ROWS_MAX rows (a chain's largest threshold + 1) keeps the one-token step's bits.


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernel (once per source, torch version and CPU) and load its ops; returns the
    library's path. Raises RuntimeError naming the cause when no compiler is found or the build fails."""
    return load_ops("bf16_rows", SOURCE, {"mm": _mm_fake, "attend": _attend_fake, "norm": _norm_fake}, cache_dir)


def _mm_fake(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])  # [M, N]


def _attend_fake(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, anc: Tensor | None = None) -> Tensor:
    return q.new_empty(q.shape)  # [1, H, M, D]


def _norm_fake(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # [..., E]


@cache
def status() -> tuple[bool, str]:
    """(True, '') when the kernel runs here (its AVX-512 BF16 build, or the portable one on any other CPU); else
    (False, why): no compiler, or a failed build. Built and decided once per process."""
    return usable(build, lambda: True, "")


@cache
def isa() -> str:
    """Which build runs here: 'avx512_bf16' (vdpbf16ps) or 'portable' (plain C++ in the same order), or '' where
    the kernel cannot run (status())."""
    if not status()[0]:
        return ""
    return "avx512_bf16" if torch.ops.polybasic_bf16_rows.native() else "portable"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] bf16 @ weight [N, K]^T (+ bias) -> [..., N] bf16, every row summed as if alone."""
    y = torch.ops.polybasic_bf16_rows.mm(x.reshape(-1, x.shape[-1]), weight, bias)  # [rows, N]
    return y.view(*x.shape[:-1], weight.shape[0])


def attend(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, anc: Tensor | None = None) -> Tensor:
    """q [1, H, M, D] bf16 over k, v [1, G, S, D] (rows contiguous), row i seeing key rows 0..pos[i] (pos [M]) ->
    [1, H, M, D] bf16, every row computed as if alone (kernels/bf16_rows.cpp). A token tree's rows: anc [M, T] int64
    holds the cache slots of row i's last T key positions pos[i]-T+1..pos[i] (its ancestors' and its own, in depth
    order; positions below read their own rows), and the row gets the bits of a call over those keys gathered."""
    return torch.ops.polybasic_bf16_rows.attend(q, k, v, pos, anc)


def norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., E] bf16 with weight [E] bf16 -> [..., E] bf16, rounded as `weight * rms_norm(x.float(),
    eps=eps).to(bf16)` is, each row's sum of squares in a fixed order (kernels/bf16_rows.cpp)."""
    return torch.ops.polybasic_bf16_rows.norm(x, weight, eps)


def choice() -> str:
    """The bf16 CPU kernel models are bound to: $POLYBASIC_BF16_KERNEL, 'bf16_rows', 'onednn' or 'auto'
    (the default): bf16_rows on every CPU, AMX included. oneDNN chooses its bf16 GEMM by shape (on CPUs with AMX,
    tiles for some row counts and AVX-512 for others), and a compiled step without the row kernels runs its
    attention as matmuls and its norms as inductor's reductions, so a row's bits would depend on how many rows a
    call has; 'onednn' is for measuring, and compiled chains over it may drift from plain decoding."""
    value = os.environ.get(CHOICE_ENV, "auto").strip().lower()
    if value not in ("auto", "bf16_rows", "onednn"):
        raise ConfigError(f"${CHOICE_ENV}={value!r}: use auto, bf16_rows or onednn")
    return "bf16_rows" if value == "auto" else value


def bind(model: nn.Module, kernel: str | None = None) -> int:
    """Mark every nn.Linear of `model` whose weight is contiguous bf16 on a CPU to run on this kernel (and
    unmark the others), and let its attention modules (those with the attribute ATTEND) run `attend` on bf16
    CPU rows and its RMSNorms (modules with the attribute NORM) run `norm`, when `kernel` (default: choice()) is
    'bf16_rows' and it can run here; returns how many linears are marked. Values are unchanged, up to the last
    bits of norms (their sums of squares in another order)."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    attentions = [m for m in model.modules() if hasattr(m, ATTEND)]
    bf16 = any(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in model.parameters())  # linears or,
    ok = bf16 and (kernel or choice()) == "bf16_rows" and status()[0]  # in a quantized copy, the norms
    for mod in linears:
        setattr(mod, MARK, ok and _fits(mod))
    for mod in attentions:
        setattr(mod, ATTEND, ok and _attention_fits(mod))
    for mod in model.modules():
        if hasattr(mod, NORM):
            setattr(mod, NORM, ok)
    return sum(getattr(mod, MARK) for mod in linears)


def _attention_fits(attn: nn.Module) -> bool:
    return attn.head_dim % 32 == 0 and attn.head_dim <= 256 and attn.n_heads % attn.n_kv == 0 \
        and attn.n_heads // attn.n_kv <= 8


def _fits(lin: nn.Linear) -> bool:
    w = lin.weight
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
