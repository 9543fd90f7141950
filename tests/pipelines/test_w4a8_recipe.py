"""A recipe whose target is 'NAME@w4a8' (a GGUF's own codes on the CPU kernel w4a8) runs every stage of the shipped
`qwen2.5-coder-1.5b-w4a8` recipe (distill, profile, plan, export) on a tiny GGUF: the head learns from the coded
target's features, the profile measures the head as trained and on 4-bit weights ('eagle:target@w4a8', paths and trees
at two ks), and the bundle decodes the target's own greedy tokens. Killed with SIGKILL in training and in the profile, the run resumes
to the same head as an uninterrupted run."""
import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from polybasic.cli import main
from polybasic.runtime import load
from polybasic.runtime.generate import generate_tokens
from polybasic.quant.api import load_any_model
from tests.pipelines.test_resume import partials, run_killed
from tests.quant.test_gguf_w4a8 import needs_vnni, tiny_gguf  # noqa: F401 (a fixture)


def _recipe(tmp_path, gguf) -> Path:
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}" + " w9" * (i % 3), "input": "",
                                 "output": f"w{i + 2} w3"} for i in range(8)]))
    recipe = {"name": "tiny-w4a8", "out_dir": str(tmp_path / "run"), "stages": ["distill", "profile", "plan", "export"],
              "model": {"source": f"{gguf}@w4a8", "dtype": "bfloat16"},
              "distill": {"data": str(data), "limit": 6, "max_new_tokens": 6, "gen_batch_size": 3, "draft_vocab_size": 64,
                          "train": {"batch_size": 2, "max_epochs": 2, "lr": 1e-3, "checkpoint_every_n_steps": 3,
                                    "precision": "bf16-mixed", "compile_loss": False}},
              "profile": {"levels": ["eagle:target@w4a8", "eagle:target@w4a8#2", "eagle:target", "ngram"], "data": str(data), "prompts": 2,
                          "max_new_tokens": 8, "k": 3, "measured_k_values": [2, 3], "context": 32, "reps": 1},
              "plan": {"k_values": [2, 3], "thresholds": [4], "max_levels": 3, "new_tokens": 16}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_w4a8_target_recipe_runs_every_stage_and_resumes_after_kills(tmp_path, tiny_gguf, capsys):  # noqa: F811
    needs_vnni()
    recipe = _recipe(tmp_path, tiny_gguf)
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert main(["run", str(recipe), "--out", str(ref)]) == 0
    argv = ["run", str(recipe), "--out", str(run)]
    run_killed(argv, "train.checkpoint:1", tmp_path)  # mid-training
    text = run_killed(argv, "profile.measure:2", tmp_path)  # the target's and one head's cost curves measured
    assert "(0 epoch(s) finished, step 3)" in text
    assert main(argv) == 0
    assert not partials(run)
    head = "distill/target/head.safetensors"
    a, b = load_file(ref / head), load_file(run / head)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "reused: cost curve of" in capsys.readouterr().out
    profile = json.loads((run / "profile.json").read_text())
    assert {"eagle:target@w4a8", "eagle:target@w4a8#2", "eagle:target", "ngram"} <= {lv["name"] for lv in profile["levels"]}
    trees = [p for p in profile["pairs"] if p["drafter"] == "eagle:target@w4a8#2"]
    assert sorted(p["k"] for p in trees) == [2, 3] and {p["tree_width"] for p in trees} == {2}  # its trees, per k
    decoder = load(str(run / "bundle"))
    target = load_any_model(f"{tiny_gguf}@w4a8", "bfloat16").model
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    assert decoder.chain.generate(prompt, 12)[0] == list(generate_tokens(target, prompt, 12, eos=decoder.chain.eos))
