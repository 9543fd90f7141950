"""Heads that read several base layers (distill.feature_layers, EAGLE-3): the base returns exactly
those layers' outputs, a new head starts as the last-layer head, and chains, the drafting loop, the
diagnostic and the distill stage all carry the wider features."""
import json

import pytest
import torch

from experiments.diagnose import sequence_drafts, walk_draft_starts
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, EagleHead, load_head, save_head
from polybasic.runtime.chain import Chain
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from tests.helpers import lean_from_hf, tiny_hf_llama


def _base(layers: int = 3):
    return lean_from_hf(tiny_hf_llama(seed=3, vocab=128, init_std=0.2, layers=layers))


def test_the_base_returns_the_named_layers_in_front_of_the_last():
    base = _base()
    tokens = torch.randint(0, 128, (2, 7))
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, y: outs.append(y.clone())) for layer in base.layers]
    with torch.inference_mode():
        base.setup_caches(8, 2)
        logits, last = base(tokens, 0)
        base.use_feature_layers([0, 1])
        wide_logits, wide = base(tokens, 0)
    for h in hooks:
        h.remove()
    e = base.args.dim
    assert wide.shape == (2, 7, 3 * e)
    assert torch.equal(wide[..., :e], outs[3]) and torch.equal(wide[..., e:2 * e], outs[4])
    assert torch.equal(wide[..., 2 * e:], last) and torch.equal(wide_logits, logits)
    for bad in ([2], [1, 0], [0, 0], [-1]):  # the last layer (2) is always read; order; repeats; range
        with pytest.raises(ConfigError, match="feature_layers"):
            base.use_feature_layers(bad)
    base.use_feature_layers([])
    with torch.inference_mode():
        assert base(tokens, 0)[1].shape == (2, 7, e)


def test_a_new_head_starts_as_the_last_layer_head():
    base = _base()
    torch.manual_seed(0)
    plain = EagleHead(DrafterConfig.for_base(base.args)).bind(_base())
    wide = EagleHead(DrafterConfig.for_base(base.args, feature_layers=[0, 1])).bind(base)
    wide.load_state_dict(plain.state_dict(), strict=False)  # same fc and block; ffuse starts at zero
    tokens, feats = torch.randint(0, 128, (1, 6)), torch.randn(1, 6, 3 * base.args.dim)
    with torch.no_grad():
        assert torch.equal(wide(tokens, feats, 0), plain(tokens, feats[..., -base.args.dim:], 0))
        assert torch.equal(wide.logits(feats), plain.logits(feats[..., -base.args.dim:]))


def test_heads_of_other_layers_take_turns_on_one_base():
    """The last head bound decides what the base returns; a chain binds its head at every start, so
    heads reading other layers can share one target, one generation after another."""
    base = _base()
    torch.manual_seed(0)
    heads = [EagleHead(DrafterConfig.for_base(base.args, feature_layers=f)).eval() for f in ([1], [], [0, 1])]
    prompt = [5, 9, 4, 7]
    answer = list(generate_tokens(base, prompt, 12))
    for head in heads + heads[:1]:
        tl = ModelLevel(base, "target")
        assert Chain([tl, EagleLevel(head, tl)], k=3).generate(prompt, 12)[0] == answer
        assert base.feature_layers == tuple(head.cfg.feature_layers)
    with pytest.raises(ConfigError, match="feature_layers"):
        DrafterConfig.for_base(base.args, feature_layers=[1, 1])


def _world():
    """A 2-layer base and a head that is nearly the base (its two blocks are the base's layers, its fuse
    layer passes the token embedding on) whose fusion of layer 0 is not zero: misplaced or wrong
    layer features change some of its drafts, and drafts of every length are accepted."""
    base = _base(layers=2)
    torch.manual_seed(0)
    head = EagleHead(DrafterConfig.for_base(base.args, feature_layers=[0], input_norms=False,
                                            feature_residual=False, n_layers=2))
    head.bind(base).init_from_base(base).eval().requires_grad_(False)
    e = base.args.dim
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(e), 0.003 * torch.randn(e, e) / e ** 0.5], 1))
        head.fc.bias.zero_()
        head.ffuse.weight.copy_(0.3 * torch.randn(e, e) / e ** 0.5)
    return base, head


def test_chains_are_lossless_and_the_diagnostic_walk_is_the_chain():
    base, head = _world()
    g = torch.Generator().manual_seed(0)
    lengths_all = []
    for i in range(8):
        prompt = torch.randint(2, 128, (3 + i % 4,), generator=g).tolist()
        answer = list(generate_tokens(base, prompt, 30))
        tl = ModelLevel(base, "target")
        out, st = Chain([tl, EagleLevel(head, tl)], k=4).generate(prompt, 30)
        assert out == answer  # lossless
        d = sequence_drafts(base, head, prompt + answer, len(prompt), 4, 30)
        lengths = [a + 1 for a in st.links[0].accepted]
        assert walk_draft_starts(d.rows) == lengths  # the drafting loop reads what unroll reads
        lengths_all += lengths
    assert max(lengths_all) >= 3  # drafts were accepted, so the comparison saw multi-token rounds
    rows = sequence_drafts(base, head, prompt + answer, len(prompt), 4, 30).rows
    with torch.no_grad():
        head.ffuse.weight.zero_()
    assert sequence_drafts(base, head, prompt + answer, len(prompt), 4, 30).rows != rows  # layer 0 is read


def test_head_round_trips_with_its_layers(tmp_path):
    base, head = _world()
    save_head(tmp_path / "h.safetensors", head)
    back = load_head(tmp_path / "h.safetensors", base)
    assert back.cfg.feature_layers == [0]
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_distill_stage_caches_wide_features_and_remakes_them_for_other_layers(tmp_path, monkeypatch):
    from polybasic.config import section_from_dict
    from polybasic.drafters.data import load_feature_shard
    from polybasic.models import load_model
    from polybasic.pipelines import distill
    from tests.helpers import tiny_hf_folder

    seen = {}

    def fake_fit(base, dataset, head_cfg, cfg, out_dir, **kw):
        seen["head_cfg"], seen["feats"] = head_cfg, dataset.samples[0].feats
        return None

    monkeypatch.setattr(distill, "fit", fake_fit)
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2, layers=3)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(3)]))
    lm = load_model(str(tmp_path / "m"))
    e = lm.args.dim
    sec = section_from_dict({"data": str(data), "max_new_tokens": 4, "feature_layers": [0, 1],
                             "feature_dtype": "float32"})
    distill.run_distill(lm, sec, tmp_path / "out")
    assert seen["head_cfg"].feature_layers == [0, 1] and seen["feats"].shape[-1] == 3 * e
    shard = tmp_path / "out" / "target" / "features" / "shard-00000.safetensors"
    s = load_feature_shard(shard)[0]
    with torch.inference_mode():
        lm.model.setup_caches(len(s.tokens), 1)
        assert torch.equal(lm.model(torch.tensor([s.tokens]), 0)[1][0], s.feats)  # the layers, as computed
    sec.feature_layers = [1]  # other layers: the shards are made again
    distill.run_distill(lm, sec, tmp_path / "out")
    assert seen["feats"].shape[-1] == 2 * e
    sec.feature_layers = [2]  # the last layer (always read) or beyond: refused before any work
    with pytest.raises(ConfigError, match="feature_layers"):
        distill.run_distill(lm, sec, tmp_path / "out2")
    assert not (tmp_path / "out2" / "samples.jsonl").exists()
    with pytest.raises(ConfigError, match="distill.feature_layers"):
        section_from_dict({"data": str(data), "feature_layers": [3, 1]})
