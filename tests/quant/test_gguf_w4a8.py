"""'NAME@w4a8' targets (quant.gguf_w4a8): a GGUF's own Q4_K and Q6_K codes on the CPU kernel w4a8, exact to the
file's weights, row-invariant, and so lossless as a chain's target (greedy identity with rejections, eager
and compiled)."""
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, make_head
from polybasic.models import loader
from polybasic.models.loader import load_model
from polybasic.models.preflight import check_source
from polybasic.quant import gguf_w4a8, w4a8
from polybasic.quant.api import load_any_model
from polybasic.runtime.chain import Chain
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import tiny_hf
from tests.models.test_gguf_codes import QWEN2_KINDS, random_blocks, write_qwen2_gguf
from tests.quant.test_w4a8 import paths, reference

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
KINDS = dict(QWEN2_KINDS, attn_k="Q4_K", token_embd="Q6_K")  # q, k Q4_K and v Q6_K in one fused linear; down Q5_0


def needs_vnni():
    if not w4a8.status()[0]:
        pytest.skip(f"the kernel cannot run here: {w4a8.status()[1]}")


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_factors_are_the_files_weights_and_the_kernel_multiplies_them(kind):
    n, k = 32, 512
    raw = random_blocks(kind, n, k, np.random.default_rng(3), scale=1e-2)
    f = gguf_w4a8.factors(kind, raw, n, k)
    ref = torch.from_numpy(np.ascontiguousarray(dequantize(raw, Q[kind]).reshape(n, k), dtype=np.float32))
    assert torch.equal(f.expand(), ref)  # every weight, bit for bit (-0.0 and 0.0 compare equal)
    w4a8.build()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    per = lambda d, q: d.double().repeat_interleave(256 // w4a8.GROUPS[f.bits], 1) * q.double()  # noqa: E731
    want, mags = reference(x, f.u, per(f.ds, f.s8), per(f.do, f.o8), w4a8.GROUPS[f.bits])
    for plain in paths():
        y = torch.ops.polybasic_w4a8.gemm(x, f.pack(), plain, f.bits)
        assert ((y.double() - want).abs() <= 1e-5 * mags + 1e-6).all(), plain


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf("qwen2", tie=True, hidden=256, heads=4, kv_heads=2, init_std=0.2)  # k-quant rows: multiples of 256
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(hf, path, np.random.default_rng(2), KINDS)
    return path


def test_bind_swaps_the_q4k_and_q6k_linears_and_keeps_the_others(tiny_gguf):
    needs_vnni()
    lm = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16")
    ref = load_model(str(tiny_gguf), "bfloat16").model
    attn, ffn = lm.model.layers[0].attention, lm.model.layers[0].feed_forward
    assert attn.wqkv.bits == (4, 6) and ffn.w13.bits == (4, 6) and attn.wo.bits == (4,)  # [q; k] Q4_K, v Q6_K
    assert lm.model.output.bits == (6,) and type(ffn.w2) is torch.nn.Linear  # the head Q6_K; down Q5_0: dense
    assert lm.name == f"{tiny_gguf}@w4a8"
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    for m in (lm.model, ref):
        m.setup_caches(64)
    with torch.inference_mode():
        got, want = lm.model(ids, 0)[0].float(), ref(ids, 0)[0].float()
    # the same weights, activations rounded to 8 bits per group: close to the bf16 model, not equal
    assert not torch.equal(got, want) and (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_binding_is_cached_per_file_and_model_and_a_bad_cache_is_rebuilt(tiny_gguf, monkeypatch, caplog):
    needs_vnni()
    first = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model
    linears = [(n, m) for n, m in load_model(str(tiny_gguf), "bfloat16").model.named_modules()
               if type(m) is torch.nn.Linear]
    cached = gguf_w4a8.cache_file(tiny_gguf, linears)
    assert [p.name for p in cached.parent.iterdir()] == [cached.name]  # written once, atomically
    real_find, real_read = gguf_w4a8._find, loader.read_state_dict
    monkeypatch.setattr(gguf_w4a8, "_find", lambda *a: pytest.fail("searched again despite the cache"))
    monkeypatch.setattr(loader, "read_state_dict", lambda *a: pytest.fail("read the dense weights despite the cache"))
    again = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model
    monkeypatch.setattr(loader, "read_state_dict", real_read)
    assert sorted(first.state_dict(keep_vars=True)) == sorted(again.state_dict(keep_vars=True))
    swapped = [(n, m) for n, m in first.named_modules() if isinstance(m, gguf_w4a8.GGUFLinear)]
    assert swapped and all(torch.equal(getattr(m, f"tiles{i}"), getattr(again.get_submodule(n), f"tiles{i}"))
                           and m.bits == again.get_submodule(n).bits for n, m in swapped for i in range(len(m.bits)))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    for m in (first, again):
        m.setup_caches(32)
    with torch.inference_mode():
        assert torch.equal(first(ids, 0)[0], again(ids, 0)[0])
    assert gguf_w4a8.cache_file(tiny_gguf, linears[1:]) != cached  # another model's linears: another file
    os.utime(tiny_gguf, ns=(1, 1))
    assert gguf_w4a8.cache_file(tiny_gguf, linears) != cached  # a changed file: another key
    os.utime(tiny_gguf, ns=(1, 2))  # back to one key, whose cache is then corrupted
    cached = gguf_w4a8.cache_file(tiny_gguf, linears)
    monkeypatch.setattr(gguf_w4a8, "_find", real_find)
    load_any_model(f"{tiny_gguf}@w4a8", "bfloat16")
    cached.write_bytes(cached.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        rebuilt = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model
    assert "ignoring the cached w4a8 binding" in caplog.text
    rebuilt.setup_caches(32)
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids, 0)[0], first(ids, 0)[0])
    assert gguf_w4a8._read_cache(cached, linears) is not None  # rewritten whole


def test_a_chain_over_a_w4a8_target_is_greedy_identical_eager_and_compiled(tiny_gguf):
    """The kernel gives a row the same bits alone and among a verification's rows, so the chain's output is the
    target's own greedy decoding, with rejections (the drafter is the same file in bf16) and rollbacks. Compiled
    steps (the target's too) get eager's bits, so the compiled chain's output is eager plain decoding's."""
    needs_vnni()
    vanilla = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model  # eager
    for compiled in (False, True):
        target = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model
        drafter = load_model(str(tiny_gguf), "bfloat16").model
        levels = [ModelLevel(target, "target"), ModelLevel(drafter, "bf16"), NGramLevel(max_ngram=2)]
        if compiled:
            assert compile_levels(levels, 128, sizes=(1, 4, 8)) > 0
        chain = Chain(levels, k=3, thresholds=[5], eos={1})
        g = torch.Generator().manual_seed(7)
        rejected = False
        for trial in range(3):
            prompt = torch.randint(2, 128, (14,), generator=g).tolist()
            prompt += prompt[:5]
            ref = list(generate_tokens(vanilla, prompt, 40, eos={1}))
            out, stats = chain.generate(prompt, 40)
            assert out == ref, (compiled, trial)
            rejected |= any(a < d for a, d in zip(stats.links[0].accepted, stats.links[0].drafted))
        assert rejected, f"no rejection by the target (compiled={compiled}): rollback not exercised"


def test_w4a8_sources_are_checked_before_loading(tiny_gguf, tmp_path):
    assert check_source(f"{tiny_gguf}@w4a8", "--model") == "gguf"
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--model: .*'@w4a8' runs a GGUF file's own codes.*folder source"):
        check_source(f"{folder}@w4a8", "--model")
    with pytest.raises(ConfigError, match="load it with polybasic.quant.load_any_model"):
        load_model(f"{tiny_gguf}@w4a8")
    with pytest.raises(ConfigError, match="runs on a CPU, not meta"):
        load_any_model(f"{tiny_gguf}@w4a8", "bfloat16", "meta")


def test_bench_vanilla_dense_runs_the_files_weights_without_the_kernel(tiny_gguf, monkeypatch):
    """`vanilla-dense[:DTYPE]` beside a NAME@w4a8 target: NAME loaded again, dense, in DTYPE (default --dtype)."""
    from polybasic.bench import methods

    loads = []
    real = methods.load_any_model
    monkeypatch.setattr(methods, "load_any_model", lambda *a: loads.append(a[:2]) or real(*a))
    prompt = torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    for method, dtype in (("vanilla-dense", "bfloat16"), ("vanilla-dense:float32", "float32")):
        dense = load_model(str(tiny_gguf), dtype).model
        ctx = methods.BenchContext(dense, None, {1}, 12, source=f"{tiny_gguf}@w4a8", dtype="bfloat16")
        assert methods.make_runner(method, ctx)(prompt, 0).tokens == list(generate_tokens(dense, prompt, 12, eos={1}))
        assert loads[-1] == (str(tiny_gguf), dtype)


def test_a_coded_linears_weight_is_the_files_and_an_eagle_head_starts_from_it(tiny_gguf):
    """GGUFLinear.dequantized_weight: the kernel's weights as floats (the file's, as the dense load reads them, to
    float rounding), so an EAGLE head over a '@w4a8' target starts from its last layer and drafts over its LM
    head's rows."""
    needs_vnni()
    coded = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model
    dense = load_model(str(tiny_gguf), "float32").model
    for name in ("layers.1.attention.wqkv", "layers.1.feed_forward.w13", "output"):
        got, want = coded.get_submodule(name).dequantized_weight(), dense.get_submodule(name).weight
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max(), name
        rows = torch.tensor([5, 0, 17, 16, want.shape[0] - 1, 5])  # any order, repeats, across tiles and parts
        assert torch.equal(coded.get_submodule(name).dequantized_weight(rows=rows), got[rows]), name
    head = make_head(DrafterConfig.for_base(coded.args, draft_vocab_size=64)).init_from_base(coded).bind(coded)
    assert torch.allclose(head.layers[0].attention.wqkv.weight, dense.layers[1].attention.wqkv.weight, atol=1e-5)
    h = torch.randn(3, coded.args.dim)
    ref = dense.output(dense.norm(h))[:, head.d2t]
    assert coded.args.tie_embeddings  # its draft rows: the float embedding's (bf16 here), not the codes'
    assert torch.allclose(head.draft_rows(torch.float32), coded.tok_embeddings.weight[head.d2t].float())
    assert torch.allclose(head.logits(h), ref, atol=1e-2 * ref.abs().max())  # bf16 rows
    object.__setattr__(coded.args, "tie_embeddings", False)  # untied: the rows of the LM head's own codes
    try:
        assert torch.allclose(head.draft_rows(torch.float32), dense.output.weight[head.d2t], atol=1e-5)
    finally:
        object.__setattr__(coded.args, "tie_embeddings", True)
