"""EAGLE-3 heads in the speculators format: our save -> load is exact; the folder computes what vLLM's
eagle3 drafter computes (a reference written from vllm/model_executor/models/llama_eagle3.py and
vllm/v1/spec_decode/llm_base_proposer.py, vLLM 0.32, fed the target's hidden states as transformers
returns them); bad folders and heads of other targets are refused before any weight loads; the
speculators library loads, saves and reloads the folder unchanged (marker vllm, its own venv)."""
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, make_head
from polybasic.models.speculators_format import load_speculators, save_speculators
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from tests.helpers import lean_from_hf, tiny_hf

LAYERS = [0, 1, 2]  # of a 4-layer base: vLLM aux ids 1, 2, 3


def eagle3_head(base, draft_vocab: int = 48, seed: int = 0, layers=LAYERS):
    """A trained-looking eagle3 head: every weight random (no zero embedding half, no identity fc)."""
    torch.manual_seed(seed)
    head = make_head(DrafterConfig.for_base(base.args, arch="eagle3", draft_vocab_size=draft_vocab,
                                            feature_layers=layers))
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(base.args.vocab_size)[:draft_vocab].sort().values)
    head.init_output_from_base(base)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.detach().std().clamp_min(0.1))
    return head.eval().requires_grad_(False)


def _world(family: str = "llama", draft_vocab: int = 48):
    hf = tiny_hf(family, seed=3, vocab=128, init_std=0.2, layers=4)
    base = lean_from_hf(hf)
    return hf, base, eagle3_head(base, draft_vocab)


@pytest.mark.parametrize("family,draft_vocab", [("llama", 48), ("llama", 0), ("qwen2", 48)])
def test_our_save_then_load_gives_every_tensor_back(tmp_path, family, draft_vocab):
    _, base, head = _world(family, draft_vocab)
    save_speculators(head, tmp_path / "spec", "verifier", k=4)
    back = load_speculators(tmp_path / "spec")
    assert back.cfg == head.cfg
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["norm_before_residual"] is False
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert c["transformer_layer_config"]["attention_bias"] == (family == "qwen2")
    t = load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert "embed_tokens.weight" not in t and t["fc.weight"].shape == (64, 3 * 64)
    assert t["layers.0.self_attn.q_proj.weight"].shape == (64, 128)  # q/k/v read [embedding; hidden]
    if draft_vocab:
        assert torch.equal(t["d2t"] + torch.arange(draft_vocab), head.d2t)  # vLLM: target = draft + d2t
        assert torch.equal(t["t2d"].nonzero().flatten(), head.d2t) and t["t2d"].dtype == torch.bool
    else:
        assert "d2t" not in t and c["draft_vocab_size"] == 128


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [T, heads, D] at positions pos [T] (HF rotate-half)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, -1)[:, None]  # [T, 1, D]
    rot = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * emb.cos() + rot * emb.sin()


class VllmEagle3:
    """vLLM 0.32's eagle3 drafter on an exported folder, written from its code (not from ours):
    llama_eagle3.py LlamaDecoderLayer.forward (layer 0, norm_before_residual false), LlamaModel.forward
    (returns the final norm's output and the pre-norm sum), combine_hidden_states (fc), compute_logits
    (draft logits scattered to target ids draft + d2t, -inf elsewhere); the embedding is the target's
    (absent from the folder: _maybe_share_embeddings). KV by position, as the paged cache holds it."""

    def __init__(self, folder, embed):
        self.w, self.c = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
        self.t, self.embed, self.kv = self.c["transformer_layer_config"], embed, {}

    def combine(self, aux):
        return aux @ self.w["fc.weight"].T

    def forward(self, ids, pos, hidden):
        w, t, p = self.w, self.t, "layers.0."
        eps, hd = t["rms_norm_eps"], t["head_dim"]
        x = torch.cat((_rms(self.embed[ids], w[p + "input_layernorm.weight"], eps),
                       _rms(hidden, w[p + "hidden_norm.weight"], eps)), -1)
        residual = hidden

        def proj(name):
            out = x @ w[f"{p}self_attn.{name}_proj.weight"].T
            bias = w.get(f"{p}self_attn.{name}_proj.bias")
            return (out if bias is None else out + bias).view(len(ids), -1, hd)

        q, k, v = _rope(proj("q"), pos, t["rope_theta"]), _rope(proj("k"), pos, t["rope_theta"]), proj("v")
        for i, at in enumerate(pos.tolist()):
            self.kv[at] = (k[i], v[i])
        rows = []
        for i, at in enumerate(pos.tolist()):
            keys = sorted(a for a in self.kv if a <= at)
            kk = torch.stack([self.kv[a][0] for a in keys], 1)  # [G, L, D]
            vv = torch.stack([self.kv[a][1] for a in keys], 1)
            rep = q.shape[1] // kk.shape[0]
            att = (q[i][:, None] @ kk.repeat_interleave(rep, 0).transpose(1, 2)) * hd ** -0.5  # [H, 1, L]
            rows.append((att.softmax(-1) @ vv.repeat_interleave(rep, 0))[:, 0].reshape(-1))
        residual = torch.stack(rows) @ w[p + "self_attn.o_proj.weight"].T + residual
        h = _rms(residual, w[p + "post_attention_layernorm.weight"], eps)
        mlp = (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        prenorm = mlp + residual
        return _rms(prenorm, w["norm.weight"], eps), prenorm

    def probs(self, normed):
        logits = normed @ self.w["lm_head.weight"].T
        if "d2t" in self.w:
            full = logits.new_full((self.t["vocab_size"],), float("-inf"))
            full[torch.arange(len(self.w["d2t"])) + self.w["d2t"]] = logits
            logits = full
        return logits.softmax(-1)

    def propose(self, aux, context, k, follow=None):
        """llm_base_proposer.propose, one request: the first pass reads context[1:] (the last one the
        verified token) at positions 0.. with the target's hidden states; every later step reads the
        previous draft token at the next position with the previous pre-norm output. Greedy drafts, or
        the tokens `follow` (to compare the distributions of sampled drafts)."""
        n = len(context)
        pos = torch.arange(n - 1)
        normed, prenorm = self.forward(torch.tensor(context[1:]), pos, self.combine(aux[:n - 1]))
        probs, toks = [self.probs(normed[-1])], []
        for _ in range(k):
            toks.append(int(probs[-1].argmax()) if follow is None else follow[len(toks)])
            if len(toks) == k:
                break
            pos = pos[-1:] + 1
            normed, prenorm = self.forward(torch.tensor(toks[-1:]), pos, prenorm[-1:])
            probs.append(self.probs(normed[-1]))
        return toks, torch.stack(probs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_exported_folder_drafts_what_vllm_computes(tmp_path, family):
    hf, base, head = _world(family)
    save_speculators(head, tmp_path / "spec", "verifier")
    ref = VllmEagle3(tmp_path / "spec", hf.model.embed_tokens.weight.detach())
    prompt = [5, 9, 4, 7, 2, 8, 11]
    context = prompt + list(generate_tokens(base, prompt, 1))  # the target's first token verified
    with torch.no_grad():
        states = hf(torch.tensor([context]), output_hidden_states=True).hidden_states  # [i]: layer i's input
    ids = json.loads((tmp_path / "spec" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    aux = torch.cat([states[i][0] for i in ids], -1)  # [T, 3E], vLLM's aux hidden states
    tl = ModelLevel(base, "target")
    level = EagleLevel(load_speculators(tmp_path / "spec", base), tl)
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        tl.start(64)
        level.start(64)
        tl.score(context[:-1], [], sampling)  # the target's pass that verified context[-1]: no feature of it
        toks, probs = level.propose(context, 4, sampling, torch.Generator().manual_seed(2), frozenset())
        with torch.no_grad():
            want_toks, want_probs = ref.propose(aux, context, 4, None if sampling.greedy else toks)
        assert toks == want_toks
        if not sampling.greedy:
            torch.testing.assert_close(probs, want_probs, atol=2e-6, rtol=1e-4)


def test_heads_of_other_targets_and_eagle1_heads_are_refused_at_export(tmp_path):
    _, base, head = _world()
    for kw, field in ((dict(hidden=32, heads=2, kv_heads=1), "DrafterConfig.dim"), (dict(vocab=96), "vocab_size"),
                      (dict(layers=3), "DrafterConfig.feature_layers")):
        other = lean_from_hf(tiny_hf("llama", seed=1, **{"vocab": 128, "layers": 4, **kw}))
        with pytest.raises(ConfigError, match=field):
            save_speculators(head, tmp_path / "x", "verifier", target=other.args)
    eagle1 = make_head(DrafterConfig.for_base(base.args))
    with pytest.raises(ConfigError, match="DrafterConfig.arch.*distill.head_arch: eagle3"):
        save_speculators(eagle1, tmp_path / "x", "verifier")
    assert not (tmp_path / "x").exists()


def _damaged(tmp_path, head, edit):
    folder = tmp_path / "spec"
    save_speculators(head, folder, "verifier")
    t = load_file(str(folder / "model.safetensors"))
    edit(t)
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("layers.0.hidden_norm.weight"), "no tensor 'layers.0.hidden_norm.weight'.*polybasic export"),
    (lambda t: t.pop("d2t"), "no tensor 'd2t'"),
    (lambda t: t.update({"fc.weight": t["fc.weight"][:, :128].contiguous()}), "'fc.weight' is F32 \\[64, 128\\]"),
    (lambda t: t.update({"d2t": t["d2t"] * 0}), "d2t: maps draft ids"),
])
def test_an_incomplete_folder_is_refused_naming_the_tensor(tmp_path, edit, match):
    _, base, head = _world()
    folder = _damaged(tmp_path, head, edit)
    with pytest.raises(ConfigError, match=match):
        load_speculators(folder, base)


def test_a_folder_is_checked_before_any_weight_loads(tmp_path, monkeypatch):
    _, base, head = _world()
    folder = _damaged(tmp_path, head, lambda t: t.pop("lm_head.weight"))
    import polybasic.models.speculators_format as fmt

    monkeypatch.setattr(fmt, "load_file", lambda *a: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match="lm_head.weight"):
        load_speculators(folder)
    c = json.loads((folder / "config.json").read_text())
    for key, value, match in (("norm_before_residual", True, "norm_before_residual"),
                              ("speculators_model_type", "eagle", "speculators_model_type")):
        (folder / "config.json").write_text(json.dumps({**c, key: value}))
        with pytest.raises(ConfigError, match=match):
            load_speculators(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in c.items() if k != "norm_before_residual"}))
    with pytest.raises(ConfigError, match="norm_before_residual: is True"):  # vLLM's default when absent
        load_speculators(folder)


def test_the_format_module_imports_neither_transformers_nor_lightning():
    code = ("import sys, polybasic.models.speculators_format; "
            "print(sorted(m for m in ('transformers', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.vllm
def test_speculators_loads_saves_and_reloads_the_folder_unchanged(tmp_path):
    """The speculators library's own round trip: from_pretrained (Eagle3DraftModel), save_pretrained,
    from_pretrained again; every tensor we wrote comes back torch.equal, and our loader reads its folder."""
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3DraftModel

    hf, base, head = _world()
    verifier = tmp_path / "verifier"
    hf.save_pretrained(verifier)
    save_speculators(head, tmp_path / "ours", str(verifier))
    first = Eagle3DraftModel.from_pretrained(str(tmp_path / "ours"))
    first.save_pretrained(str(tmp_path / "saved"))
    second = Eagle3DraftModel.from_pretrained(str(tmp_path / "saved"))
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    a, b = first.state_dict(), second.state_dict()
    for name, t in ours.items():
        assert torch.equal(a[name], t) and torch.equal(b[name], t), name
    back = load_speculators(tmp_path / "saved", base)
    sd, want = back.state_dict(), head.state_dict()
    assert all(torch.equal(sd[k], want[k]) for k in want)
