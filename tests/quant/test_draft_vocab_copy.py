"""A copy drafting over a reduced vocabulary (quantize.draft_vocab_size, quant.api.trim_lm_head): its logits are
the full head's at the kept ids and -inf elsewhere, the vocabulary survives save/load, the quantize stage
records it, and bad settings are refused. Chains with such levels: tests/runtime (greedy identity, compiled,
and the chi-square tests)."""
import copy

import pytest
import torch

from polybasic.config import QuantizeSection
from polybasic.errors import ConfigError
from polybasic.models import Transformer
from polybasic.models.eagle_head import DrafterConfig, EagleHead
from polybasic.quant import QuantConfig, load_quantized, quantize_, save_quantized
from polybasic.quant.api import read_quant_metadata, trim_lm_head
from polybasic.quant.linear import QuantLinear
from polybasic.runtime.levels import ModelLevel
from tests.helpers import lean_from_hf, tiny_hf_llama

V = 128
KEEP = torch.arange(0, V, 2)  # 64 token ids (4-bit kernels take rows in tiles of 16)
IDS = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(0))
W4 = QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack", quantize_lm_head=True)


@pytest.fixture(scope="module")
def base():
    return lean_from_hf(tiny_hf_llama(init_std=0.1))


def logits(model):
    model.setup_caches(64)
    with torch.no_grad():
        return model(IDS, 0)[0]  # [1, 24, V]


@pytest.mark.parametrize("head", ["quantized", "float"])
def test_trimmed_head_gives_the_kept_rows_and_minus_inf_elsewhere(base, head):
    full = quantize_(copy.deepcopy(base), W4) if head == "quantized" else copy.deepcopy(base)
    trimmed = trim_lm_head(copy.deepcopy(full), KEEP[torch.randperm(len(KEEP))], W4)  # any order: kept sorted
    assert torch.equal(trimmed.draft_ids, KEEP) and trimmed.output.out_features == len(KEEP)
    assert isinstance(trimmed.output, QuantLinear) == (head == "quantized")
    assert trimmed.tok_embeddings.weight.shape[0] == V  # a tied embedding keeps every row
    a, b = logits(full), logits(trimmed)
    assert b.shape == a.shape
    dropped = torch.ones(V, dtype=torch.bool)
    dropped[KEEP] = False
    assert (b[..., dropped] == float("-inf")).all()
    torch.testing.assert_close(b[..., KEEP], a[..., KEEP])
    assert set(b.argmax(-1).flatten().tolist()) <= set(KEEP.tolist())


def test_a_trimmed_copy_survives_save_and_load(base, tmp_path):
    model = trim_lm_head(quantize_(copy.deepcopy(base), W4), KEEP, W4)
    path = save_quantized(model, tmp_path / "copy.safetensors", W4)
    assert read_quant_metadata(path)[4] == len(KEEP)
    back = load_quantized(path, lambda: Transformer(base.args))
    assert torch.equal(back.draft_ids, KEEP) and back.output.out_features == len(KEEP)
    torch.testing.assert_close(logits(back), logits(model))
    assert read_quant_metadata(save_quantized(quantize_(copy.deepcopy(base), W4), tmp_path / "f.safetensors",
                                              W4))[4] == 0  # a full head records no draft vocabulary


def test_a_level_on_a_trimmed_copy_proposes_kept_tokens_over_the_full_vocabulary(base):
    from polybasic.config import SamplingConfig

    level = ModelLevel(trim_lm_head(copy.deepcopy(base), KEEP), "copy")
    level.start(64)
    tokens, q = level.propose(IDS[0, :8].tolist(), 6, SamplingConfig(temperature=1.0), torch.Generator(), frozenset())
    assert q.shape == (len(tokens), V) and set(tokens) <= set(KEEP.tolist())
    torch.testing.assert_close(q.sum(-1), torch.ones(len(tokens)))
    assert (q[:, 1::2] == 0).all()


def test_refusals(base):
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        QuantizeSection(draft_vocab_size=100)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        trim_lm_head(copy.deepcopy(base), torch.arange(V + 16))
    head = EagleHead(DrafterConfig.for_base(base.args))
    with pytest.raises(ConfigError, match="draft_vocab_size: 0"):
        head.bind(trim_lm_head(copy.deepcopy(base), KEEP))
