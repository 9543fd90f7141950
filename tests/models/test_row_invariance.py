"""Row invariance at the real models' dimensions, on the CPU at hand: every op of a bf16 decoder (linears on the GGUF's
Q4_K/Q6_K codes or in bf16, attention, RMSNorm, rope, the gated MLP, the LM head) gives a row the same bits in a
one-token step, in a verification of 2..16 rows and in a prefill, eager and compiled. A chain's greedy output equals
plain decoding's only if this holds: its target verifies several rows where plain decoding runs one.

Shapes: Qwen2.5-1.5B (hidden 1536, intermediate 8960, 12 query / 2 kv heads of 128, vocabulary 151,936) on made-up
GGUF codes, as a `NAME@w4a8` target; Qwen2.5-0.5B (896, 4864, 14 / 2 heads of 64) in bf16 on the bf16_rows kernel.
Random weights. Every failure prints which code computed each op (models.prepare.kernel_paths) and the CPU's flags.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polybasic.models import bf16_rows
from polybasic.models.args import ModelArgs
from polybasic.models.blocks import apply_rope
from polybasic.models.decoder import Transformer
from polybasic.models.native import MARCH_ENV
from polybasic.models.prepare import CPU_INDUCTOR_OPTIONS, compile_for_device, kernel_paths, prepare_for_device, \
    row_variant_ops
from polybasic.quant import gguf_w4a8, w4a8
from tests.models.test_gguf_codes import random_blocks

QWEN_15B = dict(vocab_size=151936, dim=1536, n_heads=12, n_kv_heads=2, head_dim=128, intermediate_size=8960)
QWEN_05B = dict(vocab_size=151936, dim=896, n_heads=14, n_kv_heads=2, head_dim=64, intermediate_size=4864)
VERIFY = range(1, 17)  # a one-token step and every verification size up to 16
PREFILL = 40  # a prompt's rows in one call (the bf16 linears' kernel takes up to bf16_rows.ROWS_MAX)
SIZES = (1, 2, 4, 8, 16, 64)  # compiled step sizes: 1..16 rows compile, padded; longer calls run eagerly


@pytest.fixture(scope="module", autouse=True)
def kernels():
    for name, mod in (("bf16_rows", bf16_rows), ("w4a8", w4a8)):
        ok, why = mod.status()
        if not ok:
            pytest.skip(f"the {name} kernel cannot run here: {why}")


def report(model: nn.Module | None = None) -> str:
    """Which code computed each op, for a failure's message."""
    paths = kernel_paths(model) if model is not None else {"bf16_rows": bf16_rows.isa()}
    return "\n" + "\n".join(f"  {k}: {v}" for k, v in paths.items())


SCALE = {"Q4_K": 1e-4, "Q6_K": 2e-5}  # the fp16 factors' range: weights of ~0.02, as a trained model's


def gguf_linear(parts: list[tuple[str, int]], k: int, rng, bias: bool = False) -> gguf_w4a8.GGUFLinear:
    """A linear over made-up GGUF codes: `parts` [(block type, rows)] stacked (a fused [q; k; v] mixes types)."""
    tiles = []
    for kind, n in parts:
        f = gguf_w4a8.factors(kind, random_blocks(kind, n, k, rng, scale=SCALE[kind]), n, k)
        tiles.append((f.bits, f.pack()))
    n = sum(r for _, r in parts)
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.1).bfloat16() if bias else None
    return gguf_w4a8.GGUFLinear(k, n, tiles, b)


def model(shape: dict, codes: bool) -> Transformer:
    """One decoder layer and the LM head of `shape`, random bf16 weights; codes: every linear on made-up Q4_K/Q6_K
    codes (kernel w4a8), as `NAME@w4a8` binds a GGUF's; else bf16 linears (kernel bf16_rows)."""
    args = ModelArgs(**shape, n_layers=1, qkv_bias=True, family="qwen2", rope_theta=1e6, norm_eps=1e-6,
                     max_seq_len=1024)
    with torch.device("meta"):
        m = Transformer(args)
    m = m.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    for name, p in m.named_parameters():
        scale = 0.02 if p.dim() > 1 else 0.1
        p.data = ((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g)).bfloat16()
    if codes:
        rng = np.random.default_rng(0)
        e, i, d = args.dim, args.intermediate_size, args.head_dim
        attn, ffn = m.layers[0].attention, m.layers[0].feed_forward
        attn.wqkv = gguf_linear([("Q4_K", (args.n_heads + args.n_kv_heads) * d), ("Q6_K", args.n_kv_heads * d)], e,
                                rng, bias=True)  # q, k Q4_K; v Q6_K
        attn.wo = gguf_linear([("Q4_K", e)], e, rng)
        ffn.w13 = gguf_linear([("Q4_K", i), ("Q6_K", i)], e, rng)
        ffn.w2 = gguf_linear([("Q6_K", e)], i, rng)
        m.output = gguf_linear([("Q6_K", args.vocab_size)], e, rng)
    return prepare_for_device(m.eval().requires_grad_(False))


def rows_alone(fn, x: torch.Tensor, n: int) -> torch.Tensor:
    """fn of each of x's first n rows alone (x [M, ...] -> [n, ...])."""
    return torch.cat([fn(x[i:i + 1]) for i in range(n)])


def check_rows(fn, x: torch.Tensor, what: str) -> None:
    """fn's rows (x [M, ...] -> [M, ...]) have the bits of one-row calls in calls of every size up to 16 and x's all."""
    alone = rows_alone(fn, x, 16)
    for m in [*VERIFY, x.shape[0]]:
        got = fn(x[:m])[:16]
        assert torch.equal(got, alone[:m]), f"{what}: a row's bits change in a call of {m} rows{report()}"


@pytest.mark.parametrize("shape", [QWEN_15B, QWEN_05B], ids=["1.5B", "0.5B"])
def test_every_kernel_gives_a_row_the_same_bits_in_calls_of_any_size(shape):
    g = torch.Generator().manual_seed(1)
    e, i, d = shape["dim"], shape["intermediate_size"], shape["head_dim"]
    h, kv = shape["n_heads"], shape["n_kv_heads"]
    x = torch.randn(PREFILL, e, generator=g).bfloat16()
    for n, k in ((h * d, e), (2 * i, e), (e, i), (shape["vocab_size"], e)):  # q, gate+up, down, LM head
        w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
        xk = x if k == e else torch.randn(PREFILL, k, generator=g).bfloat16()
        check_rows(lambda t: bf16_rows.linear(t, w), xk, f"bf16_rows.linear {k}->{n}")
    rng = np.random.default_rng(1)
    for kind in ("Q4_K", "Q6_K"):
        for n, k in ((2 * i, e), (e, i)) if e % 256 == 0 else ():  # k-quants need rows of 256 columns
            f = gguf_w4a8.factors(kind, random_blocks(kind, n, k, rng, scale=SCALE[kind]), n, k)
            tiles, xk = f.pack(), torch.randn(PREFILL, k, generator=g).bfloat16()
            for plain in (True, False) if torch.ops.polybasic_w4a8.vnni() else (True,):
                check_rows(lambda t: torch.ops.polybasic_w4a8.gemm(t, tiles, plain, f.bits), xk,
                           f"w4a8 {kind} {k}->{n} ({'plain loops' if plain else 'AVX-512 VNNI'})")
    w = (1 + 0.5 * torch.randn(e, generator=g)).bfloat16()
    check_rows(lambda t: bf16_rows.norm(t, w, 1e-6), (3 * x), f"bf16_rows.norm {e}")
    s = 512 + 64  # a static step's cache: more rows than any call reads
    k_, v_ = (torch.randn(1, kv, s, d, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(PREFILL, h, d, generator=g).bfloat16()
    pos = torch.arange(300, 300 + PREFILL)  # row i at position 300 + i: keys 0..300+i
    attend = lambda t, p: bf16_rows.attend(t.transpose(0, 1)[None], k_, v_, p)[0].transpose(0, 1)  # noqa: E731
    alone = torch.cat([attend(q[j:j + 1], pos[j:j + 1]) for j in range(16)])
    for m in [*VERIFY, PREFILL]:
        assert torch.equal(attend(q[:m], pos[:m])[:16], alone[:m]), f"bf16_rows.attend: {m} rows{report()}"


@pytest.mark.parametrize("shape", [QWEN_15B, QWEN_05B], ids=["1.5B", "0.5B"])
def test_compiled_pointwise_ops_round_as_eager_at_every_row_count(shape):
    """rope and the gated MLP's silu(gate) * up, fused by inductor, give eager's bits for any row count."""
    g = torch.Generator().manual_seed(2)
    h, kv, d, i = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"], shape["intermediate_size"]
    qk = torch.randn(1, 16, h + kv, d, generator=g).bfloat16()
    cos, sin = (torch.randn(16, 1, d, generator=g).bfloat16() for _ in range(2))
    gate_up = (4 * torch.randn(1, 16, 2 * i, generator=g)).bfloat16()
    ops = {"rope": lambda m: apply_rope(qk[:, :m], cos[:m], sin[:m], sin_signed=True),
           "silu(gate) * up": lambda m: (lambda a, b: F.silu(a).mul_(b))(*gate_up[:, :m].chunk(2, -1))}
    for name, op in ops.items():
        step = torch.compile(op, dynamic=False, options=CPU_INDUCTOR_OPTIONS)
        for m in (1, 3, 16):
            assert torch.equal(step(m), op(m)), f"{name}: compiled differs from eager at {m} rows{report()}"
            assert torch.equal(op(m)[:, :1], op(1)), f"{name}: eager row 0 changes at {m} rows{report()}"


@pytest.mark.parametrize("shape,codes", [(QWEN_15B, True), (QWEN_05B, False)], ids=["1.5B@w4a8", "0.5B-bf16"])
def test_a_decoder_layer_gives_one_token_steps_bits_in_verifications_prefills_and_compiled(shape, codes):
    """One layer and the LM head: eager one-token steps at positions P..P+15 are the reference; eager calls of 2..16
    rows at P, compiled steps of 1..16 rows (padded to SIZES) at P, rolled back each time, and a prefill's rows give
    their bits, logits and hidden states alike."""
    eager, comp = model(shape, codes), model(shape, codes)
    paths = report(eager)
    print(paths)  # shown with -s, and beside a failure
    assert row_variant_ops(eager) == [], paths
    compile_for_device(comp, sizes=SIZES)
    for m in (eager, comp):
        m.setup_caches(512)
    ids = torch.randint(0, shape["vocab_size"], (1, PREFILL + 16), generator=torch.Generator().manual_seed(3))
    p = PREFILL
    with torch.inference_mode():
        steps = [eager(ids[:, j:j + 1], j) for j in range(p + 16)]  # one token at a time from position 0
        one_logits = torch.cat([s[0] for s in steps[p:]], 1)  # [1, 16, V]
        one_hidden = torch.cat([s[1] for s in steps], 1)  # [1, P + 16, E]
        for name, m in (("eager", eager), ("compiled", comp)):
            lg, hd = m(ids[:, :p], 0)  # the prefill, one call (eager in both: longer than 16 rows)
            assert torch.equal(hd, one_hidden[:, :p]), f"{name} prefill of {p} rows{paths}"
            for n in VERIFY:
                lg, hd = m(ids[:, p:p + n], p)  # a verification of n rows at p (rolled back by the next call)
                assert torch.equal(lg, one_logits[:, :n]), f"{name} logits, {n} rows{paths}"
                assert torch.equal(hd, one_hidden[:, p:p + n]), f"{name} hidden states, {n} rows{paths}"
    assert {key[1] for key in comp._static.seen} == {1, 2, 4, 8, 16}, paths  # every size compiled, 40 rows eager


def test_a_model_off_the_row_kernels_names_the_ops_that_are_not_row_invariant():
    """$POLYBASIC_BF16_KERNEL=onednn (what every CPU with AMX got before the row kernels ran there): attention and norms
    leave the row kernels, and the report names them; a compiled step then computes attention as matmuls."""
    m = model(dict(QWEN_05B, vocab_size=512), codes=False)
    bf16_rows.bind(m, "onednn")
    bad = row_variant_ops(m)
    assert "layers.0.attention (attention)" in bad and "norm (norm)" in bad and "output" in bad, bad
    assert "not row-invariant" in kernel_paths(m)["attention"]
    bf16_rows.bind(m, "bf16_rows")
    assert row_variant_ops(m) == []


def test_the_portable_build_is_row_invariant_and_computes_the_native_bits(tmp_path):
    """The kernel built without AVX-512 (-march=x86-64-v3: AVX2 and FMA, what a CPU without AVX-512 BF16 compiles):
    row-invariant on its own, and, where this CPU has AVX-512 BF16, equal bit for bit to the native build."""
    out = tmp_path / "portable.pt"
    code = (f"import torch, sys; sys.path.insert(0, {str(Path(__file__).parents[2])!r}); "
            "from tests.models import test_row_invariance as t; from polybasic.models import bf16_rows; "
            "assert bf16_rows.isa() == 'portable', bf16_rows.isa(); "
            "t.test_every_kernel_gives_a_row_the_same_bits_in_calls_of_any_size(t.QWEN_05B); "
            f"torch.save(t.sample_outputs(), {str(out)!r})")
    env = dict(os.environ, **{MARCH_ENV: "x86-64-v3"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if bf16_rows.isa() == "avx512_bf16":
        theirs, ours = torch.load(out), sample_outputs()
        for name in ours:
            assert torch.equal(theirs[name], ours[name]), f"{name}: the portable build's bits differ{report()}"


def sample_outputs() -> dict[str, torch.Tensor]:
    """The three ops on fixed random inputs of the 1.5B's shapes (normal values: no subnormal flushing in play);
    attention also over a token tree's slots (anc)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 1536, generator=g).bfloat16(), (torch.randn(2048, 1536, generator=g) / 40).bfloat16()
    b = torch.randn(2048, generator=g).bfloat16()
    q, k, v = (torch.randn(1, h, n, 128, generator=g).bfloat16() for h, n in ((12, 5), (2, 300), (2, 300)))
    pos = torch.tensor([290, 291, 291, 292, 293])  # nodes at depths 0, 1, 1, 2, 3 in slots 295..299
    anc = torch.tensor([[288, 289, 290, 295], [289, 290, 295, 296], [289, 290, 295, 297], [290, 295, 297, 298],
                        [295, 297, 298, 299]])
    return {"linear": bf16_rows.linear(x, w, b), "attend": bf16_rows.attend(q, k, v, torch.arange(295, 300)),
            "attend_tree": bf16_rows.attend(q, k, v, pos, anc), "norm": bf16_rows.norm(3 * x, w[0], 1e-6)}
