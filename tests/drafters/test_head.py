"""EagleHead: cached incremental rows equal one full-sequence pass; the head's checkpoint holds only
its own weights; greedy acceptance improves after brief training."""
import torch

from polybasic.drafters.head import DrafterConfig, EagleHead
from polybasic.drafters.level import EagleLevel
from polybasic.runtime.chain import Chain
from polybasic.runtime.levels import ModelLevel
from tests.helpers import lean_from_hf, tiny_hf_llama


def test_incremental_equals_full():
    base = lean_from_hf(tiny_hf_llama(seed=1, vocab=64, init_std=0.2))
    torch.manual_seed(0)
    head = EagleHead(DrafterConfig.for_base(base.args)).bind(base).eval()
    tokens = torch.randint(0, 64, (1, 9))
    feats = torch.randn(1, 9, base.args.dim)
    with torch.no_grad():
        full = head(tokens, feats, 0)  # [1, 9, E]
        head.setup_caches(16)
        parts = [head(tokens[:, :4], feats[:, :4], 0), head(tokens[:, 4:5], feats[:, 4:5], 4),
                 head(tokens[:, 5:], feats[:, 5:], 5)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    assert set(head.state_dict()) == {k for k in head.state_dict() if k.startswith(("fc.", "layer."))}


def test_trained_head_is_accepted_more_often(tmp_path):
    from polybasic.drafters.data import DistillDataset
    from polybasic.drafters.module import TrainConfig, fit
    from polybasic.drafters.train_smoke import tiny_base, tiny_samples

    base = tiny_base()
    cfg = DrafterConfig.for_base(base.args)
    torch.manual_seed(0)
    untrained = EagleHead(cfg).bind(base).eval()
    m = fit(base, DistillDataset(tiny_samples(base, n=16), 64), cfg,
            TrainConfig(lr=3e-3, batch_size=4, max_epochs=25), tmp_path, accelerator="cpu")
    trained = m.head.eval().requires_grad_(False)

    def accepted(head):
        lvl = ModelLevel(base, "base")
        chain = Chain([lvl, EagleLevel(head, lvl)], k=4)
        return sum(sum(chain.generate(p, 24)[1].links[0].accepted)
                   for p in ([5, 9, 3, 17, 8, 2], [40, 41, 7, 7, 12, 30]))

    assert accepted(trained) > accepted(untrained)
