"""The target's eagle3 head in the speculators format: `polybasic export RECIPE --format speculators`
writes it from the distill stage's head, a bundle whose chain has it right under the target carries
it in `speculators/`, and heads vLLM cannot serve on this target are refused naming the field."""
import json
import re

import pytest
import torch
import yaml

from polybasic.cli import main
from polybasic.models import load_model
from polybasic.models.eagle_head import DrafterConfig, make_head, save_head
from polybasic.models.speculators_format import load_speculators
from polybasic.runtime import bundle as B
from polybasic.runtime.chainspec import parse_chain_spec
from polybasic.runtime.generate import generate_tokens
from tests.helpers import tiny_hf_folder
from tests.models.test_speculators_format import eagle3_head


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-target")
    tiny_hf_folder(root / "m", vocab=64, init_std=0.2, layers=3)
    return root, load_model(str(root / "m"))


def _recipe(tmp_path, root, head) -> str:
    save_head(tmp_path / "run" / "distill" / "target" / "head.safetensors", head)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "out_dir": str(tmp_path / "run"), "model": {"source": str(root / "m")},
                                    "profile": {"k": 4}}))
    return str(path)


def test_export_format_speculators_writes_the_targets_eagle3_head(target, tmp_path, capsys):
    root, lm = target
    head = eagle3_head(lm.model, 16, layers=[0, 1])
    assert main(["export", _recipe(tmp_path, root, head), "--format", "speculators"]) == 0
    folder = tmp_path / "run" / "speculators"
    assert '"method": "eagle3"' in capsys.readouterr().out
    c = json.loads((folder / "config.json").read_text())
    assert c["speculators_config"]["verifier"]["name_or_path"] == str(root / "m")
    assert c["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    back, want = load_speculators(folder, lm.model).state_dict(), head.state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want)


def _refused(argv, capsys, pattern) -> None:
    assert main(argv) != 0
    assert re.search(pattern, capsys.readouterr().err)


def test_export_refuses_heads_vllm_cannot_serve_on_the_target(target, tmp_path, capsys):
    root, lm = target
    eagle1 = _recipe(tmp_path / "a", root, make_head(DrafterConfig.for_base(lm.args)))
    _refused(["export", eagle1, "--format", "speculators"], capsys,
             "DrafterConfig.arch: is eagle1.*distill.head_arch: eagle3")
    other = tmp_path / "other"
    tiny_hf_folder(other, vocab=64, hidden=32, heads=2, kv_heads=1, layers=3)
    narrow = _recipe(tmp_path / "b", root, eagle3_head(load_model(str(other)).model, 16, layers=[0]))
    _refused(["export", narrow, "--format", "speculators"], capsys,
             "DrafterConfig.dim: is 32, the hidden_size of .* is 64")
    (tmp_path / "b" / "run" / "distill" / "target" / "head.safetensors").unlink()
    _refused(["export", narrow, "--format", "speculators"], capsys, "run `polybasic distill`")


def test_a_bundle_with_an_eagle3_head_under_the_target_carries_it_for_vllm(target, tmp_path):
    root, lm = target
    head = eagle3_head(lm.model, 16, layers=[1])
    save_head(tmp_path / "h.safetensors", head)
    folder = B.export_bundle(tmp_path / "bundle", str(root / "m"), "float32",
                             parse_chain_spec(f"eagle:{tmp_path}/h.safetensors"), B.Decoding(k=3), lm.tokenizer)
    m = json.loads((folder / "manifest.json").read_text())
    assert {"speculators/config.json", "speculators/model.safetensors"} <= set(m["files"])
    back, want = load_speculators(folder / "speculators", lm.model).state_dict(), head.state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want)
    assert '"method": "eagle3"' in (folder / "README.md").read_text()
    dec = B.load(folder)
    assert list(dec.tokens([3, 5, 7], 16)) == list(generate_tokens(lm.model, [3, 5, 7], 16))
