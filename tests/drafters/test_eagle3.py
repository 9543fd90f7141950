"""EAGLE-3 heads (DrafterConfig.arch eagle3, models.eagle_head.Eagle3Head) in our chain and trainer:
chains with one stay lossless (greedy identity, the sampled distribution), the Lightning module and the
distill stage train one, a checkpoint reloads exactly, and the config refuses what an eagle3 head lacks.
What the head computes is checked against vLLM's eagle3 drafter in tests/models/test_speculators_format.py."""
import json

import pytest
import torch

from polybasic.config import TrainConfig, section_from_dict
from polybasic.drafters.data import DistillDataset
from polybasic.drafters.module import DistillModule, fit
from polybasic.errors import ConfigError
from polybasic.models import load_model
from polybasic.models.eagle_head import DrafterConfig, Eagle3Head, eagle3_layers, load_head, make_head, save_head
from polybasic.pipelines.distill import run_distill
from polybasic.runtime.chain import Chain
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from tests.drafters.test_level import check_sampled_chain
from tests.drafters.train_smoke import tiny_base, tiny_samples
from tests.helpers import lean_from_hf, perturbed_copy, tiny_hf_folder, tiny_hf_llama
from tests.models.test_speculators_format import eagle3_head


def _target(layers: int = 3):
    return lean_from_hf(tiny_hf_llama(seed=3, vocab=128, init_std=0.2, layers=layers))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", [[5], [3, 9, 4, 7, 2, 8, 11]])
def test_greedy_chain_with_an_eagle3_head_equals_target(k, prompt):
    target = _target()
    ref = list(generate_tokens(target, prompt, 40))
    tl = ModelLevel(target, "target")
    chain = Chain([tl, EagleLevel(eagle3_head(target, layers=[0, 1]), tl)], k=k)
    out, stats = chain.generate(prompt, 40)
    assert out == ref
    assert stats.levels[1]["forwards"] > 0


def test_greedy_three_level_chain_eagle3_head_on_middle():
    hf = tiny_hf_llama(seed=3, vocab=128, init_std=0.2, layers=3)
    target, mid = lean_from_hf(hf), lean_from_hf(perturbed_copy(hf, 0.3))
    ref = list(generate_tokens(target, [3, 4, 5], 40))
    ml = ModelLevel(mid, "mid")
    chain = Chain([ModelLevel(target, "target"), ml, EagleLevel(eagle3_head(mid, 0, layers=[1]), ml)], k=3,
                  thresholds=[3])
    assert chain.generate([3, 4, 5], 40)[0] == ref


def test_sampled_chain_with_an_eagle3_head_matches_target_distribution():
    check_sampled_chain(lambda target: eagle3_head(target, 8, layers=[0]), 2468, layers=2)


def test_a_new_eagle3_head_computes_the_base_layer_after_its_highest_one():
    """init_from_base: fc passes the highest fused layer's output on and the head's layer is the next base
    layer (embedding half of q/k/v at zero), so step 1 reproduces that base layer's output exactly."""
    base = _target(layers=4)
    head = make_head(DrafterConfig.for_base(base.args, arch="eagle3", feature_layers=[0, 1])).init_from_base(base)
    head.bind(base).eval()
    tokens = torch.randint(0, 128, (1, 9))
    outs = []
    hook = base.layers[2].register_forward_hook(lambda m, a, y: outs.append(y.clone()))
    with torch.no_grad():
        base.setup_caches(9)
        feats = base(tokens, 0)[1]  # [1, 9, 3E]: layers 0, 1, then the last
        hook.remove()
        torch.testing.assert_close(head(torch.randint(0, 128, (1, 9)), feats, 0), outs[0], rtol=1e-5, atol=1e-5)


def test_train_save_load_an_eagle3_head(tmp_path):
    base = tiny_base()  # 2 layers: the head fuses layer 0
    cfg = DrafterConfig.for_base(base.args, arch="eagle3", feature_layers=[0], draft_vocab_size=16)
    tc = TrainConfig(lr=3e-3, batch_size=2, max_epochs=3, ttt_steps=2, regress="none", warmup_steps=2)
    m = fit(base, DistillDataset(tiny_samples(base), 64), cfg, tc, tmp_path, accelerator="cpu")
    assert isinstance(m.head, Eagle3Head) and sum(m.losses[-4:]) < sum(m.losses[:4])
    rows = base.output.weight[m.head.d2t]
    assert torch.equal(m.head.lm_head.weight, rows)  # the base's rows, frozen
    head = load_head(tmp_path / "head.safetensors", base)
    assert head.cfg == cfg
    assert all(torch.equal(head.state_dict()[k], v) for k, v in m.head.state_dict().items())
    with pytest.raises(ConfigError, match="distill.train.regress.*none"):
        DistillModule(base, cfg, TrainConfig(regress="prenorm"), m.head.d2t)


def test_eagle1_heads_keep_their_metadata_and_eagle3_configs_are_checked(tmp_path):
    base = tiny_base()
    save_head(tmp_path / "h.safetensors", make_head(DrafterConfig.for_base(base.args)))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h.safetensors"), "pt") as f:
        assert "arch" not in json.loads(f.metadata()["drafter_config"])  # an older polybasic reads it
    assert load_head(tmp_path / "h.safetensors").cfg.arch == "eagle1"
    assert eagle3_layers(30) == [1, 14, 26]  # vLLM's aux ids (2, 15, 27) for SmolLM2's 30 layers
    for kw, field in (({"n_layers": 2}, "DrafterConfig.n_layers"), ({"feature_residual": False}, "feature_residual"),
                      ({"arch": "eagle2"}, "DrafterConfig.arch")):
        with pytest.raises(ConfigError, match=field):
            DrafterConfig.for_base(base.args, **{"arch": "eagle3", "feature_layers": [0], **kw})
    with pytest.raises(ConfigError, match="distill.feature_layers.*2-layer"):
        DrafterConfig.for_base(base.args, arch="eagle3")
    with pytest.raises(ConfigError, match="DrafterConfig.arch.*make_head"):
        Eagle3Head(DrafterConfig.for_base(base.args))
    for d, field in (({"head_arch": "eagle3"}, "distill.train.regress"), ({"head_arch": "medusa"}, "distill.head_arch"),
                     ({"head_arch": "eagle3", "head_layers": 2, "train": {"regress": "none"}}, "distill.head_layers")):
        with pytest.raises(ConfigError, match=field):
            section_from_dict(d)


def test_distill_stage_trains_an_eagle3_head(tmp_path):
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2, layers=3)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(4)]))
    sec = section_from_dict({"data": str(data), "max_new_tokens": 8, "head_arch": "eagle3", "feature_layers": [0, 1],
                             "draft_vocab_size": 32, "train": {"batch_size": 2, "max_epochs": 1, "regress": "none"}})
    lm = load_model(str(tmp_path / "m"))
    run_distill(lm, sec, tmp_path / "out", accelerator="cpu")
    head = load_head(tmp_path / "out" / "target" / "head.safetensors", lm.model)
    assert head.cfg.arch == "eagle3" and head.cfg.feature_layers == [0, 1]
    tl = ModelLevel(lm.model, "target")
    assert Chain([tl, EagleLevel(head, tl)], k=3).generate([5, 9, 4], 12)[0] == list(generate_tokens(lm.model,
                                                                                                   [5, 9, 4], 12))
