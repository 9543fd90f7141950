"""The CPU kernel 'bf16_rows' (models.bf16_rows, kernels/bf16_rows.cpp): close to the exact product, attention
and RMSNorm, the same bits for a row whatever rows surround it, bound only where it fits, and the same bits
compiled (a whole model's steps and prompts included)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polybasic.errors import ConfigError
from polybasic.models import bf16_rows, native
from polybasic.models.blocks import RMSNorm
from polybasic.models.gguf_codes import project


@pytest.fixture(scope="module", autouse=True)
def kernel():
    ok, why = bf16_rows.status()
    if not ok:
        pytest.skip(f"the bf16_rows kernel cannot run here: {why}")


def _case(m: int, n: int, k: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


@pytest.mark.parametrize("n,k", [(4, 32), (7, 1), (33, 100), (64, 96), (130, 544)])  # blocks of 4 rows and 32
@pytest.mark.parametrize("bias", [False, True])                                   # columns, and their tails
def test_product_is_the_exact_one_rounded_to_bf16(n, k, bias):
    for m in (1, 2, 5, 6, 7, 12, 13, 14, 20):  # passes of 6 x rows, of 7 where that saves one, and remainders
        x, w, b = _case(m, n, k, bias, seed=n + k + m)
        y = bf16_rows.linear(x, w, b)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        terms = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
        # one bf16 rounding of the result (half an ulp: 2^-9 relative), plus fp32 sums over k
        assert ((y.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * terms + 1e-30).all(), m


def test_every_row_has_the_same_bits_whatever_surrounds_it():
    x, w, b = _case(20, 70, 160, True)
    full = bf16_rows.linear(x, w, b)
    # 20, 7, 13 and 14 rows run passes of 7, the others of 6
    for a, e in [(0, 1), (3, 4), (0, 2), (5, 11), (2, 20), (19, 20), (0, 17), (0, 7), (1, 14), (4, 17)]:
        assert torch.equal(bf16_rows.linear(x[a:e], w, b), full[a:e]), (a, e)
    batched = bf16_rows.linear(x.view(4, 5, 160), w, b)  # [B, M, K] rows: the same rows
    assert batched.shape == (4, 5, 70) and torch.equal(batched.reshape(20, 70), full)
    other = torch.cat([x[:1], torch.randn(6, 160).bfloat16()])  # row 0 beside other values
    assert torch.equal(bf16_rows.linear(other, w, b)[0], full[0])


def test_bind_marks_only_contiguous_bf16_cpu_linears_and_project_uses_them():
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40, bias=False), nn.Linear(40, 8)).bfloat16()
    model.requires_grad_(False)
    model[2] = model[2].float()
    model[1].weight = nn.Parameter(model[1].weight.detach().t().contiguous().t())  # a transposed view
    assert bf16_rows.bind(model, "bf16_rows") == 1
    assert [getattr(m, bf16_rows.MARK) for m in model] == [True, False, False]
    x = torch.randn(1, 3, 64).bfloat16()
    assert torch.equal(project(model[0], x), bf16_rows.linear(x, model[0].weight, model[0].bias))
    assert torch.equal(project(model[0], x[:, :1]), project(model[0], x)[:, :1])  # one row: the kernel, no padding
    long = torch.randn(1, bf16_rows.ROWS_MAX + 1, 64).bfloat16()  # a long prefill: oneDNN, faster there
    assert torch.equal(project(model[0], long), model[0](long))
    model[0].weight.requires_grad_(True)  # training: the kernel has no backward, so oneDNN's GEMM runs
    assert torch.equal(project(model[0], x), model[0](x))
    model.float()
    assert bf16_rows.bind(model, "bf16_rows") == 0 and not getattr(model[0], bf16_rows.MARK)


def test_bind_leaves_every_linear_unmarked_where_the_kernel_cannot_run(monkeypatch):
    monkeypatch.setattr(bf16_rows, "status", lambda: (False, "no C++ compiler"))
    model = nn.Sequential(nn.Linear(64, 48)).bfloat16().requires_grad_(False)
    assert bf16_rows.bind(model, "bf16_rows") == 0 and getattr(model[0], bf16_rows.MARK) is False
    x = torch.randn(1, 1, 64).bfloat16()
    assert torch.equal(project(model[0], x), model[0](torch.cat([x, torch.zeros_like(x)], 1))[:, :1])


def test_refuses_a_mismatched_input():
    x, w, _ = _case(2, 8, 64, False)
    with pytest.raises(RuntimeError, match="columns"):
        bf16_rows.linear(x[:, :32], w)
    with pytest.raises(RuntimeError, match="contiguous"):
        bf16_rows.linear(x, w.t().contiguous().t())


def test_compiled_steps_get_the_eager_bits():
    lin = nn.Linear(96, 80).bfloat16().requires_grad_(False)
    bf16_rows.bind(lin, "bf16_rows")
    step = torch.compile(lambda x: project(lin, x), dynamic=False, fullgraph=True)
    for m in (1, 4):
        x = torch.randn(1, m, 96).bfloat16()
        assert torch.equal(step(x), project(lin, x)), m


@pytest.mark.parametrize("e", [7, 16, 100, 1536])  # a masked tail alone, one vector, both, a model's width
def test_norm_is_the_rms_norm_rounded_and_every_row_alone(e):
    g = torch.Generator().manual_seed(e)
    x = (torch.randn(13, e, generator=g) * 3).bfloat16()
    w = torch.randn(e, generator=g).bfloat16()
    y = bf16_rows.norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    exact = w.double() * x.double() * (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    # two bf16 roundings (the normed row, then times the weight), half an ulp (2^-8 relative) each
    assert ((y.double() - exact).abs() <= 2 ** -7 * exact.abs() * 1.01 + 1e-30).all()
    assert torch.equal(torch.cat([bf16_rows.norm(x[i:i + 1], w, 1e-6) for i in range(13)]), y)
    assert torch.equal(bf16_rows.norm(x.view(1, 13, e), w, 1e-6), y.view(1, 13, e))
    assert torch.equal(bf16_rows.norm(x.t().contiguous().t(), w, 1e-6), y)  # strided rows: read contiguous


def test_norm_refuses_a_mismatched_input():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="last size, 64"):
        bf16_rows.norm(x, torch.ones(32).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="bf16 CPU tensor"):
        bf16_rows.norm(x.float(), torch.ones(64).bfloat16(), 1e-6)


def test_a_bf16_models_compiled_steps_and_prompts_get_the_eager_bits():
    """Every reduction of a bound bf16 model runs on the kernel (linears, attention, norms, each row alone) and
    inductor rounds every pointwise op's result as eager does (prepare.CPU_INDUCTOR_OPTIONS), so compiled steps of
    any size, padded, give the bits of eager calls, which give a row's bits in one call or several; calls longer
    than the second largest size (prompts) run eagerly, unpadded (Transformer.compile_steps)."""
    from polybasic.models.prepare import compile_for_device
    from tests.helpers import lean_from_hf, tiny_hf_llama

    hf = tiny_hf_llama(tie=True, hidden=128, heads=4, kv_heads=2)  # head size 32
    eager, comp, parts = (lean_from_hf(hf, torch.bfloat16) for _ in range(3))
    for model in (eager, comp, parts):
        bf16_rows.bind(model, "bf16_rows")
        model.setup_caches(64)
    compile_for_device(comp, sizes=(1, 4, 16))
    comp.setup_caches(64)
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for start, m in [(0, 37), (37, 1), (38, 3), (41, 4), (39, 2), (41, 16), (57, 1)]:  # with rollbacks
            a, b = eager(ids[:, start:start + m], start), comp(ids[:, start:start + m], start)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (start, m)
        assert {key[1] for key in comp._static.seen} == {1, 4}  # 37 and 16 rows ran eagerly
        whole = eager(ids[:, :40], 0)[0]
        pieces = torch.cat([parts(ids[:, a:e], a)[0] for a, e in [(0, 9), (9, 10), (10, 40)]], 1)
        assert torch.equal(whole, pieces)


def test_the_choice_is_the_row_kernel_on_every_cpu_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv(bf16_rows.CHOICE_ENV, raising=False)
    for flags in ("fpu avx512f avx512_bf16", "fpu avx512f avx512_bf16 amx_bf16 amx_tile", "fpu avx2 fma"):
        monkeypatch.setattr(native, "cpu_flags", lambda: f"flags : {flags}")  # Zen 4/5, Xeon with AMX, AVX2 only
        assert bf16_rows.choice() == "bf16_rows", flags  # the row kernels everywhere: AMX's oneDNN GEMM is not
    model = nn.Sequential(nn.Linear(64, 48)).bfloat16().requires_grad_(False)  # row-invariant
    assert bf16_rows.bind(model) == 1
    monkeypatch.setenv(bf16_rows.CHOICE_ENV, "bf16_rows")
    assert bf16_rows.choice() == "bf16_rows" and bf16_rows.bind(model) == 1
    monkeypatch.setenv(bf16_rows.CHOICE_ENV, "onednn")
    assert bf16_rows.bind(model) == 0 and not getattr(model[0], bf16_rows.MARK)
    monkeypatch.setenv(bf16_rows.CHOICE_ENV, "fast")
    with pytest.raises(ConfigError, match="POLYBASIC_BF16_KERNEL.*auto, bf16_rows or onednn"):
        bf16_rows.bind(model)


def _attention_case(h: int, g: int, d: int, m: int, s: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, r, d, generator=gen).bfloat16() for n, r in ((h, m), (g, s), (g, s)))
    return q, k, v


def _attention_exact(q, k, v, pos):
    h, m, d = q.shape[1:]
    g = k.shape[1]
    out = torch.empty(1, h, m, d, dtype=torch.float64)
    for i in range(m):
        keys = slice(0, int(pos[i]) + 1)
        for j in range(h):
            kv = j // (h // g)
            p = (q[0, j, i].double() @ k[0, kv, keys].double().T / d ** 0.5).softmax(-1)
            out[0, j, i] = p @ v[0, kv, keys].double()
    return out


@pytest.mark.parametrize("h,g,d", [(12, 2, 128), (9, 3, 64), (14, 2, 64), (4, 4, 32), (16, 2, 256)])
def test_attention_is_close_to_the_exact_one(h, g, d):
    q, k, v = _attention_case(h, g, d, 6, 70, seed=h + d)
    pos = torch.tensor([0, 1, 15, 16, 40, 69])  # one key, a key-block edge, the whole cache
    y = bf16_rows.attend(q, k, v, pos)
    exact = _attention_exact(q, k, v, pos)
    assert y.shape == q.shape and y.dtype == torch.bfloat16
    # bf16 rounding of the result (2^-9 relative) plus fp32 scores, exponentials and sums
    assert ((y.double() - exact).abs() <= 2 ** -8 * exact.abs() + 2e-3).all()


def test_attention_rows_have_the_same_bits_alone_and_read_only_their_keys():
    q, k, v = _attention_case(12, 2, 128, 9, 300)
    pos = torch.tensor([250, 251, 252, 253, 254, 255, 256, 257, 258])  # a verification's positions
    full = bf16_rows.attend(q, k, v, pos)
    for a, e in [(0, 1), (4, 5), (0, 3), (2, 9), (8, 9)]:
        assert torch.equal(bf16_rows.attend(q[:, :, a:e], k, v, pos[a:e]), full[:, :, a:e]), (a, e)
    other = torch.cat([q[:, :, :1], torch.randn(1, 12, 4, 128).bfloat16()], 2)  # row 0 beside other rows
    assert torch.equal(bf16_rows.attend(other, k, v, torch.tensor([250, 7, 8, 9, 10]))[:, :, 0], full[:, :, 0])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 259:], v2[:, :, 259:] = 1e4, -1e4  # cache rows past every position: never read
    assert torch.equal(bf16_rows.attend(q, k2, v2, pos), full)
    assert torch.equal(bf16_rows.attend(q, k[:, :, :259], v[:, :, :259], pos), full)  # a slice of the cache
    step = torch.compile(bf16_rows.attend, dynamic=False, fullgraph=True)
    assert torch.equal(step(q, k, v, pos), full)  # compiled: the same op, the same bits


def test_attention_refuses_what_it_cannot_run():
    q, k, v = _attention_case(4, 2, 48, 1, 8)
    with pytest.raises(RuntimeError, match="head size 48"):
        bf16_rows.attend(q, k, v, torch.tensor([3]))
    q, k, v = _attention_case(4, 2, 64, 2, 8)
    with pytest.raises(RuntimeError, match="1 positions for 2 rows"):
        bf16_rows.attend(q, k, v, torch.tensor([3]))
    with pytest.raises(RuntimeError, match="a negative position"):
        bf16_rows.attend(q, k, v, torch.tensor([3, -1]))


def _windows(pos: torch.Tensor, t: int) -> torch.Tensor:
    """anc [M, t] naming each row's own last t positions: the slots a call without anc reads."""
    return pos[:, None] - t + 1 + torch.arange(t)


def test_attention_with_identity_windows_is_attention_without_them():
    q, k, v = _attention_case(12, 2, 128, 9, 300)
    pos = torch.tensor([250, 251, 252, 253, 254, 255, 256, 257, 258])
    full = bf16_rows.attend(q, k, v, pos)
    for t in (1, 9):
        assert torch.equal(bf16_rows.attend(q, k, v, pos, _windows(pos, t)), full), t
    near = torch.tensor([0, 2, 15, 16, 5, 3, 1, 8, 9])  # windows reaching below position 0: those entries unused
    anc = torch.where(_windows(near, 9) < 0, 10 ** 6, _windows(near, 9))
    assert torch.equal(bf16_rows.attend(q, k, v, near, anc), bf16_rows.attend(q, k, v, near))


def _tree(m: int, prefix: int, seed: int):
    """m draft nodes after `prefix` committed rows, node i in slot prefix + perm[i] with a random earlier parent
    (node 0's: the prefix): positions [m] (prefix + depth) and anc [m, m] (the ancestors' and own slots in depth
    order, left-padded with the positions below the tree)."""
    gen = torch.Generator().manual_seed(seed)
    slot = prefix + torch.randperm(m, generator=gen)
    chains: list[list[int]] = []
    for i in range(m):
        parent = int(torch.randint(-1, i, (), generator=gen)) if i else -1
        chains.append((chains[parent] if parent >= 0 else []) + [int(slot[i])])
    pos = torch.tensor([prefix + len(c) - 1 for c in chains])
    anc = torch.tensor([list(range(prefix - m + len(c), prefix)) + c for c in chains])
    return pos, anc


@pytest.mark.parametrize("h,g,d", [(12, 2, 128), (4, 2, 64)])
def test_a_tree_nodes_attention_is_a_one_token_step_over_its_branch(h, g, d):
    prefix, m = 250, 8
    q, k, v = _attention_case(h, g, d, m, 300, seed=h)
    pos, anc = _tree(m, prefix, seed=d)
    assert len(set(pos.tolist())) > 1 and (anc[:, -1] != pos).any()  # several depths, slots not positions
    y = bf16_rows.attend(q, k, v, pos, anc)
    for i in range(m):
        rows = torch.cat([torch.arange(prefix), anc[i, m - 1 - int(pos[i]) + prefix:]])  # the branch, in order
        assert len(rows) == pos[i] + 1
        alone = bf16_rows.attend(q[:, :, i:i + 1], k[:, :, rows], v[:, :, rows], pos[i:i + 1])
        assert torch.equal(y[:, :, i:i + 1], alone), i
    step = torch.compile(bf16_rows.attend, dynamic=False, fullgraph=True)
    assert torch.equal(step(q, k, v, pos, anc), y)  # compiled with anc: the same bits


def test_attention_refuses_slots_outside_the_cache():
    q, k, v = _attention_case(4, 2, 64, 2, 8)
    pos = torch.tensor([5, 6])
    for bad in (8, -1):
        anc = _windows(pos, 3)
        anc[1, 2] = bad
        with pytest.raises(RuntimeError, match=rf"bf16_rows.attend: anc\[1\]\[2\] = {bad} is not a slot"):
            bf16_rows.attend(q, k, v, pos, anc)
    with pytest.raises(RuntimeError, match="reads rows 0..8 of a cache of 8"):  # the rows below the window
        bf16_rows.attend(q, k, v, torch.tensor([5, 10]), torch.tensor([[3, 4], [5, 6]]))
    with pytest.raises(RuntimeError, match=r"bf16_rows.attend: anc must be an integer CPU tensor \[M, T\]"):
        bf16_rows.attend(q, k, v, pos, _windows(pos, 3)[:1])
    with pytest.raises(RuntimeError, match="anc must be an integer"):
        bf16_rows.attend(q, k, v, pos, _windows(pos, 3).float())


def test_bind_lets_a_bf16_cpu_models_attention_run_the_kernel(monkeypatch):
    from tests.helpers import lean_from_hf, tiny_hf_llama

    model = lean_from_hf(tiny_hf_llama(tie=True, hidden=128, heads=4, kv_heads=2), torch.bfloat16)  # head size 32
    attentions = [layer.attention for layer in model.layers]
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    bf16_rows.bind(model, "bf16_rows")
    assert all(getattr(a, bf16_rows.ATTEND) for a in attentions)
    assert len(norms) == 2 * len(attentions) + 1 and all(getattr(n, bf16_rows.NORM) for n in norms)
    bf16_rows.bind(model, "onednn")
    assert not any(getattr(a, bf16_rows.ATTEND) for a in attentions)
    assert not any(getattr(n, bf16_rows.NORM) for n in norms)
    bf16_rows.bind(model.float(), "bf16_rows")  # fp32: nothing for the kernel
    assert not any(getattr(a, bf16_rows.ATTEND) for a in attentions)
    monkeypatch.setattr(bf16_rows, "status", lambda: (False, "no C++ compiler"))
    bf16_rows.bind(model.bfloat16(), "bf16_rows")
    assert not any(getattr(a, bf16_rows.ATTEND) for a in attentions)


def test_compile_caches_are_keyed_by_the_kernels_built():
    """A graph inductor cached against another build of a kernel (another schema) is not reused: each loaded
    library's key is part of torch.compile's cache key tag, after the user's own tag, sorted, once."""
    from polybasic.models import native

    if not bf16_rows.status()[0]:
        pytest.skip(f"the bf16_rows kernel cannot run here: {bf16_rows.status()[1]}")
    before = torch.compiler.config.cache_key_tag
    assert len([p for p in before.split("|") if p.startswith("polybasic_bf16_rows-")]) == 1
    with torch.compiler.config.patch(cache_key_tag="mine|polybasic_b-1"):
        native.tag_compile_caches("a-2")
        native.tag_compile_caches("a-2")
        assert torch.compiler.config.cache_key_tag == "mine|polybasic_a-2|polybasic_b-1"
    assert torch.compiler.config.cache_key_tag == before
