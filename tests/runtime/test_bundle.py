"""Chain bundles: export -> load gives the chain that was exported (token for token), a Hub id
loads offline from the HF cache, push goes through HfApi, and every bad bundle is refused with a
clear error before any model loads."""
import copy
import json
import shutil

import numpy as np
import pytest
import torch

from polybasic.errors import ConfigError, PolybasicError
from polybasic.models import load_model
from polybasic.models.eagle_head import DrafterConfig, EagleHead, save_head
from polybasic.quant import QuantConfig, quantize_, save_quantized, w4a8
from polybasic.quant.api import load_any_model
from polybasic.quant.gguf_w4a8 import GGUFLinear
from polybasic.runtime import bundle as B
from polybasic.runtime.chain import Chain
from polybasic.runtime.chain_builder import build_chain
from polybasic.runtime.chainspec import parse_chain_spec
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.hub import push_bundle
from tests.helpers import tiny_hf, tiny_hf_folder
from tests.models.test_gguf_codes import QWEN2_KINDS, write_qwen2_gguf

W4 = QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A tiny target folder, its quantized copy, and a head trained (randomly) on the copy."""
    root = tmp_path_factory.mktemp("bundle-parts")
    tiny_hf_folder(root / "target", vocab=64, init_std=0.2)
    lm = load_model(str(root / "target"))
    q = quantize_(copy.deepcopy(lm.model), W4)
    save_quantized(q, root / "q.safetensors", W4, source=str(root / "target"))
    for seed in (0, 1):
        torch.manual_seed(seed)
        save_head(root / f"head{seed}.safetensors", EagleHead(DrafterConfig.for_base(lm.args)).bind(q))
    return root, lm


def _export(parts, out, spelling=None, **kw):
    root, lm = parts
    spec = parse_chain_spec(spelling or f"{root}/q.safetensors+eagle:{root}/head0.safetensors")
    return B.export_bundle(out, str(root / "target"), "float32", spec, B.Decoding(k=3, thresholds=(4,)),
                           lm.tokenizer, plan={"predicted_speedup": 1.7}, machine={"cpu": "test"},
                           recipe_yaml="name: test\n", **kw)


def test_export_then_load_is_the_profiled_chain(parts, tmp_path):
    root, lm = parts
    folder = _export(parts, tmp_path / "bundle")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "levels", "manifest.json", "recipe.yaml"]
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: polybasic") and "1.70x" in card
    prompt = [3, 5, 7, 9]
    spec = parse_chain_spec(f"{root}/q.safetensors+eagle:{root}/head0.safetensors")
    direct = Chain(build_chain(spec, lm), k=3, thresholds=[4])
    want, _ = direct.generate(prompt, 24)
    dec = B.load(folder)
    got = list(dec.tokens(prompt, 24))
    assert got == want == list(generate_tokens(lm.model, prompt, 24))[:len(got)]
    assert dec.stats.new_tokens == len(got) and dec.predicted_speedup == 1.7
    assert [lv.kind for lv in dec.manifest.chain.levels] == ["quantized", "eagle"]
    assert dec.generate("w1 w2 w3", 8, chat=False) == dec.tokenizer.decode(
        list(dec.tokens("w1 w2 w3", 8, chat=False)), skip_special_tokens=True)


def test_draft_confidence_travels_in_the_manifest_and_old_manifests_load(parts, tmp_path):
    """Decoding.draft_confidence is written, read back and given to the chain; a manifest written before
    the field existed loads with it off; a bad value is refused naming the field."""
    root, lm = parts
    spec = parse_chain_spec(f"{root}/q.safetensors+eagle:{root}/head0.safetensors")
    folder = B.export_bundle(tmp_path / "b", str(root / "target"), "float32", spec,
                             B.Decoding(k=3, thresholds=(4,), draft_confidence=0.4), lm.tokenizer,
                             plan={"predicted_speedup": 1.7}, machine={"cpu": "test"}, recipe_yaml="name: t\n")
    dec = B.load(folder)
    assert dec.manifest.decoding.draft_confidence == 0.4 and dec.chain.draft_confidence == 0.4
    assert list(dec.tokens([3, 5, 7, 9], 16)) == list(generate_tokens(lm.model, [3, 5, 7, 9], 16))
    m = json.loads((folder / "manifest.json").read_text())
    del m["decoding"]["draft_confidence"]
    (folder / "manifest.json").write_text(json.dumps(m))
    assert B.load(folder).chain.draft_confidence == 0.0
    with pytest.raises(ConfigError, match=r"^draft_confidence: must be in \[0, 1\)"):
        B.Decoding(draft_confidence=1.5)


def test_a_hub_id_loads_offline_from_the_hf_cache(parts, tmp_path, monkeypatch):
    folder = _export(parts, tmp_path / "bundle")
    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-chain"
    rev = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    dec = B.load("someone/tiny-chain")
    assert dec.folder == repo / "snapshots" / rev
    assert list(dec.tokens([3, 5, 7], 8)) == list(B.load(folder).tokens([3, 5, 7], 8))
    with pytest.raises(PolybasicError, match="not in the local Hugging Face cache"):
        B.load("someone/absent")


class RecordingApi:
    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, **kw):
        self.calls.append(("upload_folder", kw["repo_id"], kw))
        return type("Info", (), {"commit_url": f"https://hub.invalid/{kw['repo_id']}/commit/1"})()


def test_push_creates_the_repo_and_uploads_the_folder(parts, tmp_path):
    folder = _export(parts, tmp_path / "bundle")
    api = RecordingApi()
    url = push_bundle(folder, "someone/tiny-chain", private=True, api=api)
    (c1, repo1, kw1), (c2, repo2, kw2) = api.calls
    assert (c1, repo1, kw1["repo_type"], kw1["private"], kw1["exist_ok"]) == \
        ("create_repo", "someone/tiny-chain", "model", True, True)
    assert (c2, repo2, kw2["folder_path"]) == ("upload_folder", "someone/tiny-chain", str(folder))
    assert url.endswith("/commit/1")
    with pytest.raises(PolybasicError, match="no manifest.json"):
        push_bundle(tmp_path, "someone/x", api=api)
    with pytest.raises(PolybasicError, match="owner/name"):
        push_bundle(folder, "not-an-id", api=api)


def _edit_manifest(folder, fn):
    path = folder / "manifest.json"
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _level_file(folder, kind):
    return next((folder / "levels").glob(f"*-{kind}.safetensors"))


BAD = {
    "newer schema": (lambda f: _edit_manifest(f, lambda d: d.update(schema_version=B.SCHEMA_VERSION + 1)),
                     "schema_version 2 is newer than this polybasic"),
    "missing level file": (lambda f: _level_file(f, "eagle").unlink(), "is missing"),
    "sha256 mismatch": (lambda f: shutil.copyfile(f.parent.parent / "parts" / "head1.safetensors",
                                                  _level_file(f, "eagle")), "has sha256"),
    "corrupted safetensors": (lambda f: _level_file(f, "quantized").write_bytes(
        _level_file(f, "quantized").read_bytes()[:1000]), "truncated"),
    "unknown level kind": (lambda f: _edit_manifest(f, lambda d: d["chain"]["levels"][0].update(kind="medusa")),
                           "unknown level kind 'medusa'"),
    "tokenizer mismatch": (lambda f: _edit_manifest(f, lambda d: d["target"].update(tokenizer_sha256="0" * 64)),
                           "tokenizer differs"),
    "another target build": (lambda f: _edit_manifest(f, lambda d: d["target"].update(sha256="f" * 64)),
                             "another build of the model"),
    "vocabulary mismatch of a model level": (
        lambda f: _edit_manifest(f, lambda d: d["references"].update(
            {"other": {"source": "x", "vocab_size": 99, "tokenizer_sha256": "1" * 64}})),
        "has another tokenizer than the target"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_bundles_are_refused_before_any_model_loads(parts, tmp_path, monkeypatch, case):
    root, _ = parts
    (tmp_path / "parts").symlink_to(root)
    folder = _export(parts, tmp_path / "b" / "bundle")
    damage, message = BAD[case]
    damage(folder)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the bundle was checked")

    monkeypatch.setattr("polybasic.models.loader.load_model", no_load)
    monkeypatch.setattr("polybasic.quant.api.load_quantized_model", no_load)
    with pytest.raises(PolybasicError, match=message) as e:
        B.load(folder)
    assert str(folder) in str(e.value)


def test_export_refuses_a_model_level_without_its_tokenizer(parts, tmp_path):
    root, _ = parts
    with pytest.raises(PolybasicError, match="pass its tokenizer"):
        _export(parts, tmp_path / "bundle", spelling=f"{root}/target@bfloat16+ngram")
    assert not (tmp_path / "bundle").exists()


def _cli(*args, **kw):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "polybasic.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def test_generate_and_bench_with_a_bundle_from_a_fresh_process(parts, tmp_path):
    root, lm = parts
    folder = _export(parts, tmp_path / "bundle")
    r = _cli("generate", "--bundle", str(folder), "--prompt", "w1 w2 w3", "--no-chat", "--max-new-tokens", "12",
             "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ids = lm.tokenizer.encode("w1 w2 w3")
    assert out["text"] == lm.tokenizer.decode(list(generate_tokens(lm.model, ids, 12)), skip_special_tokens=True)
    assert [lv["name"] for lv in out["stats"]["levels"]][0] == "target" and len(out["stats"]["levels"]) == 3
    qs = tmp_path / "q.jsonl"
    qs.write_text("".join(json.dumps({"question_id": i, "turns": [f"w{i} w{i + 1} w{i}"]}) + "\n" for i in range(3)))
    r = _cli("bench", "--bundle", str(folder), "--questions", str(qs), "--max-new-tokens", "8", "--warmup", "0",
             "--no-progress", "--json", str(tmp_path / "b.json"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "b.json").read_text())
    assert set(doc["methods"]) == {"vanilla", "chain"}
    assert doc["methods"]["chain"]["predicted_speedup"] == 1.7 and doc["methods"]["vanilla"]["predicted_speedup"] is None
    assert doc["methods"]["chain"]["identical_to_vanilla"] == "3/3"
    assert "1.70" in r.stdout  # predicted printed beside measured


def test_a_bad_bundle_on_the_command_line(parts, tmp_path):
    folder = _export(parts, tmp_path / "bundle")
    _edit_manifest(folder, lambda d: d.update(schema_version=B.SCHEMA_VERSION + 1))
    for args in (["generate", "--bundle", str(folder), "--prompt", "w1"],
                 ["bench", "--bundle", str(folder), "--json", str(tmp_path / "out.json")],
                 ["push", str(folder), "someone/x"]):
        r = _cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert str(folder) in r.stderr and "schema_version" in r.stderr
    assert not (tmp_path / "out.json").exists()


def test_a_target_on_its_ggufs_own_codes_travels_in_a_bundle(tmp_path, monkeypatch):
    """A 'NAME@w4a8' target: the manifest names it so and identifies NAME's file; the loaded bundle runs the
    GGUF's codes and gives that target's own greedy tokens."""
    if not w4a8.status()[0]:
        pytest.skip(f"the kernel cannot run here: {w4a8.status()[1]}")
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny-qwen2.gguf"
    hf = tiny_hf("qwen2", tie=True, hidden=256, heads=4, kv_heads=2, init_std=0.2)  # k-quant rows: 256 columns
    write_qwen2_gguf(hf, gguf, np.random.default_rng(2), dict(QWEN2_KINDS, attn_k="Q4_K", token_embd="Q6_K"))
    source = f"{gguf}@w4a8"
    lm = load_any_model(source, "bfloat16")
    folder = B.export_bundle(tmp_path / "b", source, "bfloat16", parse_chain_spec("ngram"),
                             B.Decoding(k=3, thresholds=None), lm.tokenizer)
    ref = json.loads((folder / "manifest.json").read_text())["target"]
    assert ref["source"] == source and ref["sha256"] == B.source_sha256(str(gguf))
    dec = B.load(folder)
    assert isinstance(dec.target.model.layers[0].attention.wo, GGUFLinear)
    prompt = [3, 5, 7, 9, 3, 5, 7]
    assert list(dec.tokens(prompt, 20)) == list(generate_tokens(lm.model, prompt, 20))
