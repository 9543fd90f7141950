"""quant.quantize_head keeps a head's 4-bit tensors in the cache: a later call loads them, with outputs equal to the
bit to a fresh rounding; a damaged copy is rounded again and replaced; another head gets its own."""
import warnings

import pytest
import torch

from polybasic.models.eagle_head import DrafterConfig, make_head
from polybasic.quant import api
from polybasic.config import QuantConfig
from polybasic.quant.api import quantize_, quantize_head, quantized_modules
from polybasic.quant.linear import QuantLinear
from tests.helpers import lean_from_hf, tiny_hf_llama


def fresh_head(base, arch: str, seed: int = 3, draft_vocab: int | None = 48):
    torch.manual_seed(seed)
    extra = {"feature_layers": (0,)} if arch == "eagle3" else {}
    cfg = DrafterConfig.for_base(base.args, arch=arch, draft_vocab_size=draft_vocab, **extra)
    head = make_head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.05)
    if head.d2t is not None:
        head.d2t.copy_(torch.randperm(base.args.vocab_size)[:draft_vocab].sort().values)
    return head.bind(base).to(base.dtype).eval().requires_grad_(False)


def outputs(head, base) -> dict[str, torch.Tensor]:
    """Every quantized module's output on one input, and the head's logits."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for fqn in quantized_modules(head):
        m = head.get_submodule(fqn)
        out[fqn] = m(torch.randn(3, m.in_features, generator=g).to(base.dtype))
    out["logits"] = head.logits(torch.randn(3, base.args.dim, generator=g).to(base.dtype))
    return out


def quantized(base, arch, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # w4a8 where VNNI is missing: torch's int4 kernel, with a warning
        return quantize_head(fresh_head(base, arch), "w4a8", **kw)


@pytest.fixture(scope="module")
def base():
    return lean_from_hf(tiny_hf_llama(seed=0, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2), torch.bfloat16)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_a_cached_head_loads_without_rounding_and_equals_a_fresh_one(base, arch, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path))
    first = outputs(quantized(base, arch), base)
    files = list((tmp_path / "quantized-heads").glob("*.safetensors"))
    assert len(files) == 1
    monkeypatch.setattr(QuantLinear, "from_float", classmethod(lambda *a, **k: pytest.fail("rounded again")))
    again = outputs(quantized(base, arch), base)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)

    files[0].write_bytes(files[0].read_bytes()[:100])  # damaged: rounded again, with a warning, and replaced
    monkeypatch.undo()
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path))
    with caplog.at_level("WARNING"):
        mended = outputs(quantized(base, arch), base)
    assert "cannot be read" in caplog.text
    assert all(torch.equal(first[k], mended[k]) for k in first)
    assert files[0].stat().st_size > 1000


def test_another_head_or_no_cache_rounds_its_own(base, tmp_path, monkeypatch):
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path))
    one = outputs(quantized(base, "eagle1"), base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = fresh_head(base, "eagle1")
        with torch.no_grad():
            other.fc.weight[0, 0] += 1.0  # a tensor differs: another key
        quantize_head(other, "w4a8")
    assert len(list((tmp_path / "quantized-heads").glob("*.safetensors"))) == 2
    calls = []
    monkeypatch.setattr(api, "_load_quantized_head", lambda *a: calls.append(a) or False)
    uncached = outputs(quantized(base, "eagle1", cache=False), base)
    assert not calls and all(torch.equal(one[k], uncached[k]) for k in one)



def test_an_eagle1_heads_file_follows_the_rows_it_reads(tmp_path, monkeypatch):
    """Its draft rows come from EagleHead.rows_source: behind a tied LM head on 4-bit codes, the float embedding;
    another embedding, another file, though the LM head's codes are the same."""
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path))
    for bump in (0.0, 1.0):
        b = lean_from_hf(tiny_hf_llama(seed=0, vocab=96, hidden=64, layers=2, heads=4, kv_heads=2), torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(b, QuantConfig(w_bits=4, group_size=32, kernel="w4a8"), lambda m, fqn: fqn == "output")
        with torch.no_grad():
            b.tok_embeddings.weight[5, 0] += bump  # after rounding: the LM head's codes stay as they were
        assert b.args.tie_embeddings and fresh_head(b, "eagle1").rows_source() is b.tok_embeddings
        quantized(b, "eagle1")
    assert len(list((tmp_path / "quantized-heads").glob("*.safetensors"))) == 2
