"""Reduced draft vocabulary (EAGLE-3 style): proposals only from the N kept tokens, distributions
over the full vocabulary (zero elsewhere), chain still lossless; the mapping survives save/load."""
import pytest
import torch

from polybasic.config import SamplingConfig, TrainConfig
from polybasic.drafters.data import DistillDataset, Sample
from polybasic.drafters.module import fit
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, EagleHead, frequent_tokens, load_head
from polybasic.runtime.chain import Chain
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from polybasic.runtime.sampling import make_generator
from tests.drafters.test_level import check_sampled_chain
from tests.drafters.train_smoke import tiny_base, tiny_samples
from tests.helpers import lean_from_hf, tiny_hf_llama


def reduced_head(model, n, seed=0):
    torch.manual_seed(seed)
    head = EagleHead(DrafterConfig.for_base(model.args, draft_vocab_size=n)).bind(model)
    head.set_draft_vocab(torch.randperm(model.args.vocab_size)[:n].sort().values)
    return head.eval().requires_grad_(False)


def test_frequent_tokens():
    samples = [Sample([9, 9, 3, 3, 3, 5], 2), Sample([1, 5, 5], 1)]
    assert frequent_tokens(samples, 2, 10).tolist() == [3, 5]
    assert frequent_tokens(samples, 4, 10).tolist() == [0, 1, 3, 5]  # remainder by id


def test_greedy_lossless_and_proposals_in_vocab():
    target = lean_from_hf(tiny_hf_llama(seed=3, vocab=128, init_std=0.2))
    ref = list(generate_tokens(target, [3, 9, 4], 30))
    tl = ModelLevel(target, "target")
    head = reduced_head(target, 20)
    lvl = EagleLevel(head, tl)
    assert Chain([tl, lvl], k=4).generate([3, 9, 4], 30)[0] == ref
    lvl.start(64)
    toks, q = lvl.propose([3, 9, 4], 4, SamplingConfig(temperature=1.0), make_generator(0, target.device), frozenset())
    assert set(toks) <= set(head.d2t.tolist()) and q.shape == (4, 128)
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    # the confidence of a greedy draft: the drafted token's share of the draft vocabulary's softmax
    assert Chain([tl, lvl], k=6, draft_confidence=0.2).generate([3, 9, 4], 30)[0] == ref
    greedy_probs = lvl.propose([3, 9, 4], 1, SamplingConfig(), None, frozenset())[1][0]
    tok = int(greedy_probs.argmax())
    want = torch.softmax(lvl.logits[0].float(), -1)[head.d2t.tolist().index(tok)]
    assert lvl.confidence(0, tok, greedy_probs, SamplingConfig()) == pytest.approx(float(want))


def test_sampled_chain_matches_target_distribution():
    check_sampled_chain(lambda target: reduced_head(target, 8), 4321)


def test_save_load_and_train(tmp_path):
    base = tiny_base()
    m = fit(base, DistillDataset(tiny_samples(base), 64), DrafterConfig.for_base(base.args, draft_vocab_size=16),
            TrainConfig(lr=3e-3, batch_size=2, max_epochs=2), tmp_path, accelerator="cpu")
    assert all(torch.isfinite(torch.tensor(m.losses)))
    head = load_head(tmp_path / "head.safetensors", base)
    assert torch.equal(head.d2t, m.head.d2t)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DrafterConfig.for_base(base.args, draft_vocab_size=base.args.vocab_size + 1)
