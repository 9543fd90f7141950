"""`python -m experiments.draft_vocab`: one trained eagle1 head drafting over draft vocabularies of several sizes."""
import json

import torch

from experiments import draft_vocab
from polybasic.models.eagle_head import DrafterConfig, make_head, save_head
from polybasic.models.loader import load_model
from tests.helpers import tiny_hf_folder


def test_a_head_drafts_over_wider_vocabularies(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=128, heads=4, kv_heads=2, layers=2)
    lm = load_model(str(tmp_path / "tiny"), "bfloat16")
    torch.manual_seed(0)
    head = make_head(DrafterConfig.for_base(lm.args, draft_vocab_size=16)).init_from_base(lm.model)
    (tmp_path / "run" / "distill" / "target").mkdir(parents=True)
    save_head(tmp_path / "run" / "distill" / "target" / "head.safetensors", head)
    samples = [{"tokens": [(i * 7 + j) % 60 + 2 for j in range(20)], "n_prompt": 5} for i in range(6)]
    (tmp_path / "run" / "distill" / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"say {i} {i}", "input": "", "output": "x"} for i in range(4)]))
    out = draft_vocab.main(["--model", str(tmp_path / "tiny"), "--run", str(tmp_path / "run"), "--sizes", "16,64",
                            "--kernel", "", "--data", str(data), "--prompts", "2", "--max-new-tokens", "10"])
    assert set(out) == {16, 64} and all(r["tau"] >= 1.0 and 0 <= r["step1"] <= 1 for r in out.values())
    assert "draft vocabulary 64" in capsys.readouterr().out
