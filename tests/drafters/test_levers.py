"""Drafter-quality levers: the regression target (train.regress), feature_residual saved with the
head, and the distill fields (gen_dtype / feature_dtype float32, references, prompt_loss)."""
import json

import pytest
import torch
import torch.nn.functional as F

from polybasic.config import TrainConfig, section_from_dict
from polybasic.drafters.data import collate
from polybasic.drafters.module import DistillModule, _step_losses
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, EagleHead, load_head, save_head
from tests.drafters.train_smoke import tiny_base, tiny_samples


@pytest.fixture(scope="module")
def world():
    base = tiny_base()
    return base, collate(tiny_samples(base, n=2))


def _train(world, steps=2, **kw):
    base, batch = world
    torch.manual_seed(0)
    m = DistillModule(base, DrafterConfig.for_base(base.args), TrainConfig(**kw))
    opt = torch.optim.AdamW(m.head.parameters(), lr=3e-3)
    outs = []
    for _ in range(steps):
        out = m.losses_for(batch, noise=False)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        outs.append({k: float(v.detach()) for k, v in out.items()})
    return m, outs


@pytest.mark.parametrize("regress", ["prenorm", "postnorm", "none"])
@pytest.mark.parametrize("ttt", [1, 2])
def test_regress_options_train(world, regress, ttt):
    _, outs = _train(world, regress=regress, ttt_steps=ttt)
    for o in outs:
        assert all(torch.isfinite(torch.tensor(v)) for v in o.values())
    if regress == "none":
        assert all(o["vloss"] == 0.0 for o in outs)
        if ttt == 1:
            assert all(o["loss"] == o["ploss"] for o in outs)  # p_weight 1: the token loss alone
    else:
        assert all(o["vloss"] > 0 for o in outs)


def _old_vloss(out, nxt, mask):
    """The regression term as written before `regress` existed."""
    m = mask.to(torch.float32)
    denom = m.sum().clamp_min(1.0)
    r = nxt.detach().pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    return (F.smooth_l1_loss(out.float() / r, nxt / r, reduction="none").mean(-1) * m).sum() / denom


def test_prenorm_is_the_old_loss_and_postnorm_is_the_normed_one(world):
    base, batch = world
    torch.manual_seed(0)
    head = EagleHead(DrafterConfig.for_base(base.args)).bind(base)
    tokens, mask = batch["tokens"], batch["mask"]
    base.setup_caches(tokens.shape[1], tokens.shape[0])
    hidden = base(tokens, 0)[1].float()
    out = head(tokens[:, 1:], hidden[:, :-1]) + 0.1 * torch.randn_like(hidden[:, 1:])
    with torch.no_grad():
        tl = F.log_softmax(head.logits(hidden[:, 1:]), -1)
    target = {"probs": tl.exp(), "top": tl.argmax(-1), "entropy": -(tl.exp() * tl).sum(-1)}
    nxt, mk = hidden[:, 1:], mask[:, 1:]
    sel = mk > 0  # _step_losses takes the learned rows only
    rows = (out[sel], nxt[sel], {k: v[sel] for k, v in target.items()})
    assert TrainConfig().regress == "prenorm"
    pre = _step_losses(head, *rows)
    torch.testing.assert_close(pre["vloss"], _old_vloss(out, nxt, mk))  # the same mean, summed in another order
    assert torch.equal(_step_losses(head, *rows, "prenorm")["vloss"], pre["vloss"])
    post = _step_losses(head, *rows, "postnorm")
    m = mk.float()
    want = (F.smooth_l1_loss(base.norm(out), base.norm(nxt), reduction="none").mean(-1) * m).sum() / m.sum()
    assert torch.allclose(post["vloss"], want)
    assert torch.equal(post["ploss"], pre["ploss"])  # only the regression term changes
    post["vloss"].backward()
    assert head.fc.weight.grad is not None and base.norm.weight.grad is None  # the base stays frozen
    none = _step_losses(head, *rows, "none")
    assert float(none["vloss"]) == 0.0 and torch.equal(none["ploss"], pre["ploss"])


def _reference_losses(m, batch, regress):
    """losses_for as first written: every row through the LM heads, log-softmax, masked means."""
    tokens, mask = batch["tokens"], batch["mask"]
    t = tokens.shape[1]
    m.base.setup_caches(t, tokens.shape[0])
    hidden = m.base(tokens, 0)[1].float()
    outs = m.head.unroll(tokens, hidden[:, :-1], m.cfg.ttt_steps) if m.cfg.ttt_steps > 1 else [
        m.head(tokens[:, 1:], hidden[:, :-1], 0)]
    tl = F.log_softmax(m.head.logits(hidden[:, 1:]), -1, dtype=torch.float32)
    raw = [m.cfg.ttt_decay ** j for j in range(len(outs))]
    total, first = 0.0, None
    for j, out in enumerate(outs):
        n = t - 1 - j
        mk = mask[:, 1 + j:].float()
        o, nxt, p, tj = out[:, :n], hidden[:, 1 + j:], tl[:, j:].exp(), tl[:, j:]
        if regress == "prenorm":
            v = _old_vloss(o, nxt, mk)
        else:
            v = torch.zeros(())
        lp = F.log_softmax(m.head.logits(o), -1, dtype=torch.float32)
        ce = -(p * lp).sum(-1)
        ploss = (ce * mk).sum() / mk.sum()
        kl = ((ce + (p * tj).sum(-1)) * mk).sum() / mk.sum()
        acc = ((lp.argmax(-1) == tj.argmax(-1)).float() * mk).sum() / mk.sum()
        total = total + raw[j] / sum(raw) * (v + ploss)
        first = first or {"vloss": v, "ploss": ploss, "kl": kl, "acc": acc}
    return {"loss": total, **first}


@pytest.mark.parametrize("regress,ttt,compiled", [("prenorm", 1, True), ("none", 1, True), ("prenorm", 3, True),
                                                  ("none", 3, True), ("prenorm", 3, False)])
def test_losses_on_the_learned_rows_equal_the_masked_full_rows(world, regress, ttt, compiled):
    """The LM heads run on the learned rows only (the mask's), and the cross-entropy is logsumexp(z) -
    p.z (compiled or not): the same losses as every row through log-softmax with the mask applied after."""
    base, batch = world
    torch.manual_seed(0)
    m = DistillModule(base, DrafterConfig.for_base(base.args),
                      TrainConfig(regress=regress, ttt_steps=ttt, compile_loss=compiled))
    with torch.no_grad():
        for prm in m.head.parameters():
            prm.add_(0.05 * torch.randn_like(prm))  # away from the init, so that every term matters
    assert batch["mask"][:, 1:].sum() < batch["mask"][:, 1:].numel()  # some rows are left out
    got, want = m.losses_for(batch, noise=False), _reference_losses(m, batch, regress)
    for k in ("loss", "vloss", "ploss", "kl", "acc"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_regress_is_validated():
    with pytest.raises(ConfigError, match=r"distill\.train\.regress.*prenorm, postnorm, none"):
        TrainConfig(regress="eagle")
    with pytest.raises(ConfigError, match=r"distill\.train\.regress"):
        section_from_dict({"train": {"regress": "post"}})
    assert section_from_dict({"train": {"regress": "postnorm"}}).train.regress == "postnorm"


def test_feature_residual_false_round_trips(world, tmp_path):
    base, batch = world
    torch.manual_seed(0)
    head = EagleHead(DrafterConfig.for_base(base.args, feature_residual=False)).bind(base)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.1)
    save_head(tmp_path / "h.safetensors", head)
    back = load_head(tmp_path / "h.safetensors", base)
    assert back.cfg.feature_residual is False and back.cfg == head.cfg
    tokens = batch["tokens"]
    base.setup_caches(tokens.shape[1], tokens.shape[0])
    feats = base(tokens, 0)[1][:, :-1]
    with torch.no_grad():
        assert torch.equal(back(tokens[:, 1:], feats), head(tokens[:, 1:], feats))
        residual = EagleHead(DrafterConfig.for_base(base.args)).bind(base)
        residual.load_state_dict(head.state_dict())
        assert not torch.equal(residual(tokens[:, 1:], feats), head(tokens[:, 1:], feats))  # the flag matters


def test_head_without_the_key_loads_with_the_old_default(world, tmp_path):
    from safetensors.torch import save_file

    base, _ = world
    head = EagleHead(DrafterConfig.for_base(base.args))
    cfg = head.cfg.to_dict()
    del cfg["feature_residual"]
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp_path / "old.safetensors"),
              {"drafter_config": json.dumps(cfg), "format": "polybasic-eagle-head"})
    assert load_head(tmp_path / "old.safetensors", base).cfg.feature_residual is True


def test_distill_lever_fields():
    sec = section_from_dict({"gen_dtype": "float32", "feature_dtype": "float32", "references": False,
                             "feature_residual": False, "train": {"prompt_loss": True, "regress": "none"}})
    assert (sec.gen_dtype, sec.feature_dtype, sec.references, sec.feature_residual) == ("float32", "float32",
                                                                                       False, False)
    assert sec.train.prompt_loss and sec.train.regress == "none"
    d = section_from_dict({})
    assert (d.gen_dtype, d.feature_dtype, d.references, d.feature_residual) == ("bfloat16", "bfloat16", True, True)
    with pytest.raises(ConfigError, match=r"distill\.gen_dtype.*float32"):
        section_from_dict({"gen_dtype": "float8"})
    with pytest.raises(ConfigError, match=r"distill\.feature_dtype"):
        section_from_dict({"feature_dtype": "int4"})
    with pytest.raises(ConfigError, match=r"distill\.feature_residual"):
        section_from_dict({"feature_residual": "no"})


def test_distill_plumbs_feature_residual_and_feature_dtype(tmp_path, monkeypatch):
    from polybasic.drafters.data import load_feature_shard
    from polybasic.models import load_model
    from polybasic.pipelines import distill
    from tests.helpers import tiny_hf_folder

    seen = {}

    def fake_fit(base, dataset, head_cfg, cfg, out_dir, **kw):
        seen["head_cfg"], seen["feats"], seen["samples"] = head_cfg, dataset.samples[0].feats, dataset.samples
        return None

    monkeypatch.setattr(distill, "fit", fake_fit)
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(3)]))
    lm = load_model(str(tmp_path / "m"))
    sec = section_from_dict({"data": str(data), "max_new_tokens": 4, "feature_residual": False,
                             "feature_dtype": "float32"})
    distill.run_distill(lm, sec, tmp_path / "out")
    assert seen["head_cfg"].feature_residual is False
    assert seen["feats"].dtype == torch.float32  # cached as computed, not rounded to bf16
    shard = tmp_path / "out" / "target" / "features" / "shard-00000.safetensors"
    fp32 = load_feature_shard(shard)[0].feats
    sec.feature_dtype = "bfloat16"  # another feature_dtype: the shards are made again
    distill.run_distill(lm, sec, tmp_path / "out")
    assert seen["feats"].dtype == torch.bfloat16
    err = (seen["feats"].float() - fp32).norm() / fp32.norm()
    assert 0 < err < 0.05  # a bf16 copy's features: close, not the same
    before = [s.tokens for s in seen["samples"]]
    sec.max_new_tokens = 6  # longer answers: trained on the new samples' features, not the cached shard's
    distill.run_distill(lm, sec, tmp_path / "out")
    made = [json.loads(x)["tokens"] for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert made != before and [s.tokens for s in seen["samples"]] == made
