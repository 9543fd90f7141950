"""The CPU kernel 'w4a8' (quant.w4a8, kernels/w4a8.cpp) and its linear: exact to its own arithmetic on
every path, close to the float weights, a clear fallback where it cannot run."""
import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from polybasic.config import QuantConfig
from polybasic.errors import ConfigError
from polybasic.quant import linear as qlinear
from polybasic.quant import w4a8
from polybasic.quant.api import load_quantized, quantize_, save_quantized
from polybasic.quant.linear import DequantLinear, Int4PackLinear, W4A8Linear, keep_dense_for_prefill
from tests.helpers import lean_from_hf, tiny_hf_llama

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
W4A8 = QuantConfig(w_bits=4, group_size=32, kernel="w4a8")


def reference(x, u, s, o, group=32):
    """The kernel's arithmetic in float64 for the scales and offsets [N, K/group] it computes with:
    (y [M, N], the summed magnitudes of its terms [M, N])."""
    m, k = x.shape
    xg = x.float().view(m, k // group, group)
    amax = xg.abs().amax(-1, keepdim=True)
    inv = torch.full_like(amax, 127.0) / amax  # IEEE division, as the kernel's (torch's 127 / t can be 1 ulp off)
    xq = torch.where(amax > 0, torch.round(xg * inv), torch.zeros_like(xg)).double()
    a, xsum = (amax[..., 0] / 127).double(), xg.sum(-1).double()  # [M, G]
    dots = torch.einsum("mgk,ngk->mng", xq, u.double().view(u.shape[0], -1, group))  # [M, N, G]
    scaled, offset = dots * s.double()[None] * a[:, None], o.double()[None] * xsum[:, None]
    return (scaled + offset).sum(-1), (scaled.abs() + offset.abs()).sum(-1)


def q6k_like(n, k, g):
    """Random Q6_K-like rows as the kernel's 6-bit factors: codes u = q in [0, 63], s = d * sc per 16
    columns (int8 sc, fp16 d per 256), o = -32 s -> (u, (ds, s8, do, o8), s, o)."""
    u = torch.randint(0, 64, (n, k), generator=g)
    ds = (torch.rand(n, -(-k // 256), generator=g) * 1e-3 + 1e-4).half()
    s8 = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    s = ds.float().repeat_interleave(16, 1)[:, :k // 16] * s8.float()
    return u, (ds, s8, -32 * ds, s8), s, -32 * s


def paths():
    """The plain loops on any CPU, and VNNI where the CPU has it."""
    return [True] + ([False] if torch.ops.polybasic_w4a8.vnni() else [])


@needs_cxx
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (64, 576), (32, 1024), (128, 8192)])  # 1, 3, 18 (8 + 8 + 2), 32
# and 256 groups
def test_kernel_equals_its_float64_reference_on_every_path(n, k):
    w4a8.build()
    ops = torch.ops.polybasic_w4a8
    g = torch.Generator().manual_seed(n + k)
    u = torch.randint(0, 16, (n, k), generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    o = -8 * s + torch.randn(n, k // 32, generator=g) * 1e-3
    tiles = w4a8.pack(u, s, o)
    for m in (1, 2, 3, 4, 5, 8, 9, 17):  # blocks of up to 8 rows and their remainders
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 0  # an all-zero activation group (its scale is 0)
        ref, mags = reference(x, u, w4a8.effective(s), w4a8.effective(o))  # the factored scales it computes with
        for plain in paths():
            y = ops.gemm(x, tiles, plain)
            assert y.shape == (m, n) and y.dtype == x.dtype
            assert ((y.double() - ref).abs() <= 1e-5 * mags + 1e-6).all(), (m, plain)
        if m > 2:  # rows whose outputs are NaN, and near the top of the range (bf16's stores round in registers)
            x[1, 3], x[2] = float("nan"), x[2] * 1e36
        for dt in (torch.bfloat16, torch.float16):  # read and written in x's dtype: as fp32 in, rounded once out
            got, want = w4a8.mm(x.to(dt), tiles), w4a8.mm(x.to(dt).float(), tiles)
            nan = want.isnan()  # NaN rows: NaN (the payload is the conversion's own)
            assert torch.equal(got.isnan(), nan) and nan.any() == (m > 2), (m, dt)
            assert torch.equal(got[~nan].view(torch.int16), want[~nan].to(dt).view(torch.int16)), (m, dt)


@needs_cxx
@pytest.mark.parametrize("n,k", [(16, 16), (32, 272), (16, 1536)])  # 1, 17 (16 + 1) and 96 groups of 16
def test_6bit_codes_equal_their_float64_reference_on_every_path(n, k):
    w4a8.build()
    g = torch.Generator().manual_seed(n + k)
    u, factors, s, o = q6k_like(n, k, g)
    tiles = w4a8.pack_factors(u, *factors, bits=6)
    assert tiles.shape == (n // 16, w4a8.tile_bytes(k, 6)) == (n // 16, -(-k // 256) * 64 + k // 16 * 224)
    with pytest.raises(ValueError, match=r"\[0, 63\], got 64"):
        w4a8.pack_factors(u + 1, *factors, bits=6)
    for m in (1, 3, 8, 9):
        x = torch.randn(m, k, generator=g)
        x[0, :16] = 0
        ref, mags = reference(x, u, s, o, group=16)
        for plain in paths():
            y = torch.ops.polybasic_w4a8.gemm(x, tiles, plain, 6)
            assert ((y.double() - ref).abs() <= 1e-5 * mags + 1e-6).all(), (m, plain)


@needs_cxx
@pytest.mark.parametrize("bits", [4, 6])
def test_every_row_has_the_same_bits_alone_and_among_others(bits):
    """What a target's kernel must give: a verification's rows equal one-token steps bit for bit."""
    w4a8.build()
    g = torch.Generator().manual_seed(bits)
    n, k = 32, 512
    if bits == 6:
        u, factors, *_ = q6k_like(n, k, g)
        tiles = w4a8.pack_factors(u, *factors, bits=6)
    else:
        tiles = w4a8.pack(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g) * 0.02,
                          -torch.rand(n, k // 32, generator=g) * 0.1)
    x = torch.randn(17, k, generator=g).bfloat16()
    for plain in paths():
        rows = torch.ops.polybasic_w4a8.gemm(x, tiles, plain, bits)
        for m in (1, 2, 5, 8, 9, 17):
            assert torch.equal(torch.ops.polybasic_w4a8.gemm(x[:m], tiles, plain, bits), rows[:m]), (m, plain)
        assert all(torch.equal(torch.ops.polybasic_w4a8.gemm(x[i:i + 1], tiles, plain, bits), rows[i:i + 1])
                   for i in range(17))


def test_layout_places_each_code_and_factor_where_the_kernel_reads_it():
    n, k = 16, 9 * 32  # two super-blocks: 8 groups, then 1
    u = (torch.arange(n * k) % 16).view(n, k)
    s = torch.full((n, k // 32), 63 / 128)  # Q4_K-like: 6-bit integers times an fp16 factor (1/128)
    s[3, 2] = 32 / 128
    tiles = w4a8.pack(u, s, -s)  # [1, 2 * 64 + 9 * 288]
    assert tiles.shape == (1, w4a8.tile_bytes(k)) == (1, 2 * 64 + 9 * 288)
    for row, col in [(0, 0), (3, 5), (15, 31), (7, 48), (9, 63), (4, 270)]:
        g, c = divmod(col, 32)
        half, r = divmod(c, 16)
        block = 64 * (1 + g // 8) + 288 * g  # after the header of the group's super-block
        byte = tiles[0, block + (r // 4) * 64 + 4 * row + r % 4]
        assert int((byte >> (4 * half)) & 15) == int(u[row, col])
    head = tiles[0, :64].view(torch.float16).float()  # super-block 0: per row d of the scales, then of the offsets
    s8, o8 = tiles[0, 64 + 256:64 + 288].view(torch.int8).view(2, 16)  # group 0's int8 scales and offsets
    assert torch.equal(head[:16] * s8, s[:, 0]) and torch.equal(head[16:] * o8, -s[:, 0])
    assert head[:16].tolist() == [1 / 128] * 16 and s8.tolist() == [63] * 16
    assert torch.equal(w4a8.effective(s), s)


def test_factors_keep_q4k_scales_exact_and_others_within_a_step():
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(8, 3, generator=g) * 0.01).half().float()  # Q4_K: an fp16 factor per 256 columns ...
    sc = torch.randint(0, 64, (8, 24), generator=g)  # ... times 6-bit integers
    sc[:, ::8] = 63
    s = d.repeat_interleave(8, 1) * sc
    assert torch.equal(w4a8.effective(s), s)
    v = torch.randn(8, 20, generator=g)  # anything else: int8 steps of max |v| / 127 per super-block
    step = F.pad(v, (0, 4)).abs().view(8, 3, 8).amax(-1).repeat_interleave(8, 1)[:, :20] / 127
    assert ((w4a8.effective(v) - v).abs() <= 0.5001 * step + 1e-9).all()


@needs_cxx
def test_kernel_refuses_a_mismatched_input():
    w4a8.build()
    tiles = w4a8.pack(torch.zeros(16, 64, dtype=torch.long), torch.ones(16, 2), torch.zeros(16, 2))
    with pytest.raises(RuntimeError, match="columns"):
        w4a8.mm(torch.randn(1, 32), tiles)
    with pytest.raises(RuntimeError, match="bytes"):  # the width is named, never guessed from the bytes (4-bit
        w4a8.mm(torch.randn(1, 64), tiles, bits=6)  # tiles of 448 columns have the bytes of 6-bit ones of 288)


@needs_cxx
def test_linear_is_close_to_its_float_weights_and_runs_long_prefills_on_the_kernel():
    if not w4a8.status()[0]:
        pytest.skip(f"the fast path cannot run here: {w4a8.status()[1]}")
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 48, bias=True)
    mod = W4A8Linear.from_float(lin, W4A8, "l")
    assert mod.tiles is not None and mod.packed.numel() == 0  # torch's int4 layout is not built
    ref = DequantLinear.from_float(lin, QuantConfig(w_bits=4, group_size=32, kernel="dequant"))
    for m in (1, 3, 7):
        x = torch.randn(2, m, 96)
        assert ((mod(x) - ref(x)).abs().max() / ref(x).abs().max()) < 0.02  # int8 activations per group of 32
    x = torch.randn(W4A8Linear.gemm_rows + 3, 96).bfloat16()  # a long bf16 prefill: the kernel, each row alone
    assert torch.equal(mod(x), torch.cat([mod(x[i:i + 1]) for i in range(len(x))]))
    assert mod._dense_rows is None and keep_dense_for_prefill(torch.nn.Sequential(mod)) == 0


def test_linear_falls_back_to_torchs_int4_kernel_with_a_warning(monkeypatch):
    monkeypatch.setattr(w4a8, "status", lambda: (False, "no C++ compiler 'g++' on PATH"))
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 32)
    with pytest.warns(UserWarning, match="cannot run here .no C.. compiler"):
        qlinear._warn_once.cache_clear()  # warned once per process and message
        mod = W4A8Linear.from_float(lin, W4A8, "l")
    assert mod.tiles is None
    int4 = Int4PackLinear.from_float(lin, QuantConfig(w_bits=4, group_size=32, kernel="int4pack"), "l")
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(mod(x), int4(x))


def test_config_and_shapes_are_checked_before_any_work():
    with pytest.raises(ConfigError, match="QuantConfig.kernel.*groups of 32"):
        QuantConfig(w_bits=4, group_size=64, kernel="w4a8")
    with pytest.raises(ConfigError, match="l: kernel 'w4a8' needs out_features % 16"):
        W4A8Linear(64, 40, W4A8, name="l")
    assert W4A8Linear.check_shape(64, 32, W4A8, "cuda", "l") == "runs on cpu, not cuda"


@needs_cxx
def test_a_saved_copy_loads_with_the_kernel_and_decodes_alike(tmp_path):
    hf = tiny_hf_llama(seed=2, vocab=96, hidden=64, layers=1, heads=4, kv_heads=2)
    q = quantize_(lean_from_hf(hf, torch.bfloat16), QuantConfig(w_bits=4, group_size=32, kernel="int4pack"))
    save_quantized(q, tmp_path / "q.safetensors", QuantConfig(w_bits=4, group_size=32, kernel="int4pack"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without VNNI falls back, with its warning
        w = load_quantized(tmp_path / "q.safetensors", lambda: lean_from_hf(hf, torch.bfloat16), kernel="w4a8")
    kinds = {type(m) for m in w.modules()}
    assert W4A8Linear in kinds and Int4PackLinear not in kinds - {W4A8Linear}
    x = torch.tensor([[3, 5, 7, 9]])
    w.setup_caches(16)
    q.setup_caches(16)
    a, b = w(x, 0)[0], q(x, 0)[0]
    assert (a - b).abs().max() < 0.1 * b.abs().max()  # another kernel of the same codes


def test_an_eager_chain_through_a_w4a8_copy_is_the_targets_greedy_output():
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.levels import ModelLevel, NGramLevel
    from tests.helpers import perturbed_copy

    hf = tiny_hf_llama(seed=4, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.2)
    target = lean_from_hf(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CPU without VNNI runs torch's int4 kernel instead
        copy = quantize_(lean_from_hf(perturbed_copy(hf, 0.02, 1), torch.bfloat16), W4A8)
    assert any(isinstance(m, W4A8Linear) for m in copy.modules())
    chain = Chain([ModelLevel(target, "target"), ModelLevel(copy, "w4a8"), NGramLevel(max_ngram=2)], k=3,
                  thresholds=[6], eos={1})
    g = torch.Generator().manual_seed(5)
    rejected = False
    for _ in range(3):
        prompt = torch.randint(2, 96, (13,), generator=g).tolist()
        out, stats = chain.generate(prompt, 40)
        assert out == list(generate_tokens(target, prompt, 40, eos={1}))
        rejected |= any(a < d for a, d in zip(stats.links[0].accepted, stats.links[0].drafted))
    assert rejected  # rollbacks exercised
