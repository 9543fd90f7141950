"""Chains spelled as text, including a quantized copy of the target saved by the quant API."""
import copy

import pytest

from polybasic.errors import ConfigError
from polybasic.models import load_model
from polybasic.quant import QuantConfig, quantize_, save_quantized
from polybasic.runtime.chain import Chain
from polybasic.runtime.chain_builder import parse_chain
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import tiny_hf_folder


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_folder(path, hidden=48, init_std=0.2)
    return load_model(str(path))


def test_quantized_copy_level(target, tmp_path):
    q = copy.deepcopy(target.model)
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=16, kernel="dequant")
    save_quantized(quantize_(q, cfg), tmp_path / "q.safetensors", cfg)
    levels = parse_chain(f"target+{tmp_path / 'q.safetensors'}+ngram:2", target)
    assert [type(lv) for lv in levels] == [ModelLevel, ModelLevel, NGramLevel]
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = list(generate_tokens(target.model, prompt, 24))
    out, stats = Chain(levels, k=3).generate(prompt, 24)
    assert out == ref
    assert stats.to_dict()["links"][0]["mean_accepted_length"] > 1  # the quantized copy drafts well


@pytest.mark.parametrize("spec, match", [("target", "names no level"), ("ngram+", "empty level name"),
                                         ("ngram:x", "integer n-gram size")])
def test_bad_specs(target, spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_chain(spec, target)


def test_eagle_head_level(target, tmp_path):
    """`eagle:PATH` drafts on the features of the model level right above it; greedy stays exact."""
    import torch

    from polybasic.models.eagle_head import DrafterConfig, EagleHead, save_head
    from polybasic.runtime.eagle_level import EagleLevel

    torch.manual_seed(0)
    save_head(tmp_path / "h.safetensors", EagleHead(DrafterConfig.for_base(target.args)).init_from_base(target.model))
    levels = parse_chain(f"target@bfloat16+eagle:{tmp_path / 'h.safetensors'}", target)
    assert [type(lv) for lv in levels] == [ModelLevel, ModelLevel, EagleLevel]
    assert levels[2].base is levels[1]  # the head reads the bf16 copy's features
    prompt = [5, 6, 7, 8, 5, 6, 7]
    out, _ = Chain(parse_chain(f"eagle:{tmp_path / 'h.safetensors'}", target), k=4).generate(prompt, 24)
    assert out == list(generate_tokens(target.model, prompt, 24))
    with pytest.raises(ConfigError, match="not a model"):
        parse_chain(f"ngram+eagle:{tmp_path / 'h.safetensors'}", target)


def test_another_model_level_must_share_the_targets_tokenizer(target, tmp_path):
    tiny_hf_folder(tmp_path / "same", hidden=32, layers=1, init_std=0.2)  # another model, same tokenizer
    levels = parse_chain(str(tmp_path / "same"), target)
    assert [lv.name for lv in levels] == ["target", str(tmp_path / "same")]
    tiny_hf_folder(tmp_path / "other", vocab=32, hidden=32, layers=1)
    with pytest.raises(ConfigError, match=r"chain: level '.*other'.*tokenizer differs from the target's"):
        parse_chain(str(tmp_path / "other"), target)


def test_level_cache_shares_levels_between_chains(target, tmp_path):
    """Chains built with one cache share each level (and a head keeps reading the level it drafts on);
    every chain stays greedy-exact after the other ran."""
    import torch

    from polybasic.models.eagle_head import DrafterConfig, EagleHead, save_head

    torch.manual_seed(0)
    head = tmp_path / "h.safetensors"
    save_head(head, EagleHead(DrafterConfig.for_base(target.args)).init_from_base(target.model))
    cache: dict = {}
    a = parse_chain(f"target@bfloat16+eagle:{head}", target, cache=cache)
    b = parse_chain("target@bfloat16+ngram:2", target, cache=cache)
    c = parse_chain(f"eagle:{head}", target, cache=cache)
    d = parse_chain(f"target@bfloat16+eagle:{head}", target, cache=cache)
    assert a[0] is b[0] is c[0] and a[1] is b[1] and a[2] is d[2]
    assert a[2].base is a[1] and c[1].base is c[0] and c[1] is not a[2]  # heads keyed by what they read
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = list(generate_tokens(target.model, prompt, 24))
    for levels in (a, b, c, d):
        assert Chain(levels, k=3).generate(prompt, 24)[0] == ref
