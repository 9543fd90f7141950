"""The distill stage end to end on a tiny HF folder: samples, head.safetensors, resume; field errors."""
import json

import pytest

from polybasic.config import section_from_dict
from polybasic.errors import ConfigError
from polybasic.models import load_model
from polybasic.models.eagle_head import load_head
from polybasic.pipelines.distill import run_distill
from tests.helpers import tiny_hf_folder


def test_distill_stage(tmp_path):
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(8)]))
    sec = section_from_dict({"data": str(data), "max_new_tokens": 8,
                             "train": {"batch_size": 2, "max_epochs": 1, "lr": 1e-3}})
    lm = load_model(str(tmp_path / "m"))
    m = run_distill(lm, sec, tmp_path / "out", accelerator="cpu")["target"]
    assert len(m.losses) == 4
    assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 8
    assert len(list((tmp_path / "out" / "target" / "features").glob("*.safetensors"))) == 1
    load_head(tmp_path / "out" / "target" / "head.safetensors", lm.model)
    sec.train.max_epochs = 2
    assert len(run_distill(lm, sec, tmp_path / "out", accelerator="cpu")["target"].losses) == 4  # resumed: epoch 2
    # more sequences: the checkpoint is set aside and training starts afresh (2 epochs of 5 steps), not resumed
    more = tmp_path / "more.json"
    more.write_text(json.dumps([{"instruction": f"w{i + 1} w{i}", "input": "", "output": ""} for i in range(2)]))
    sec.more_data = section_from_dict({"more_data": [str(more)]}).more_data
    assert len(run_distill(lm, sec, tmp_path / "out", accelerator="cpu")["target"].losses) == 10
    assert (tmp_path / "out" / "target" / "checkpoints" / "stale-last.ckpt").is_file()


def test_self_instruct_prompts_join_the_data(tmp_path):
    from polybasic.pipelines.distill import _samples

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(3)]))
    sec = section_from_dict({"data": str(data), "max_new_tokens": 4, "self_instruct": 2})
    samples = _samples(load_model(str(tmp_path / "m")), sec, tmp_path)
    assert len(samples) == 5 and all(s.tokens[0] == 2 for s in samples)  # every prompt opens a user turn
    assert samples[3].tokens[:samples[3].n_prompt] != samples[4].tokens[:samples[4].n_prompt]


def test_more_data_is_answered_after_data_and_keeps_its_answers(tmp_path, monkeypatch):
    """Adding a prompt set (distill.more_data) answers only its prompts: data's answers come from their shards, in
    front, as before; the set's reference answers join where it has some."""
    from polybasic.drafters import data as distill_data
    from polybasic.pipelines.distill import _samples

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    lm = load_model(str(tmp_path / "m"))
    data, more = tmp_path / "d.json", tmp_path / "more.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(6)]))
    more.write_text(json.dumps([{"instruction": f"w{i} w9", "input": "", "output": "w7 w8" if i == 20 else ""}
                                for i in range(20, 23)]))
    base = {"data": str(data), "max_new_tokens": 4, "gen_batch_size": 4}
    before = _samples(lm, section_from_dict(base), tmp_path / "out")
    answered = []
    real = distill_data.generate_batch
    monkeypatch.setattr(distill_data, "generate_batch", lambda m, ids, *a: answered.append(ids) or real(m, ids, *a))
    after = _samples(lm, section_from_dict({**base, "more_data": [str(more)]}), tmp_path / "out")
    assert [len(ids) for ids in answered] == [3]  # one batch: the new set's three prompts
    assert [s.tokens for s in after[:len(before)]] == [s.tokens for s in before]
    assert len(after) == len(before) + 3 + 1  # its answers, then its one reference answer
    assert (tmp_path / "out" / "samples" / "more-0" / "inputs.json").is_file()
    with pytest.raises(ConfigError, match=r"distill.more_data\[1\].*Spec-Bench"):
        section_from_dict({"more_data": [str(more), "spec-bench"]})


def test_self_instruct_openings_key_the_answers(tmp_path):
    from polybasic.pipelines.distill import _inputs_key

    tiny_hf_folder(tmp_path / "m", vocab=64)
    lm = load_model(str(tmp_path / "m"))
    free = _inputs_key(lm, section_from_dict({"self_instruct": 2}))
    seeded = _inputs_key(lm, section_from_dict({"self_instruct": 2, "self_instruct_openings": ["w5"]}))
    assert "self_instruct_openings" not in free  # runs made before openings existed keep their shards
    assert seeded["self_instruct_openings"] == "['w5']" and {**seeded, "self_instruct_openings": None} != free


def test_section_errors():
    with pytest.raises(ConfigError, match="distill.self_instruct"):
        section_from_dict({"self_instruct": -1})
    with pytest.raises(ConfigError, match="distill.self_instruct_openings.*self_instruct is 0"):
        section_from_dict({"self_instruct_openings": ["Summarize: "]})
    with pytest.raises(ConfigError, match=r"distill.self_instruct_openings\[1\]: expected str"):
        section_from_dict({"self_instruct": 4, "self_instruct_openings": ["ok", 3]})
    with pytest.raises(ConfigError, match="distill.train: strategy"):
        section_from_dict({"train": {"strategy": "nope"}})
    with pytest.raises(ConfigError, match="distill.data.*Spec-Bench"):
        section_from_dict({"data": "spec-bench"})
    with pytest.raises(ConfigError, match="distill: unknown field"):
        section_from_dict({"epochs": 3})
    with pytest.raises(ConfigError, match="distill.drafters"):
        section_from_dict({"drafters": ["target", "draft"]})
    with pytest.raises(ConfigError, match="distill.head_layers"):
        section_from_dict({"head_layers": 0})
    with pytest.raises(ConfigError, match="distill.features"):
        section_from_dict({"features": "disk"})


def test_distill_command_runs_a_recipe(tmp_path):
    import yaml

    from polybasic.cli import main

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 2}", "input": "", "output": ""} for i in range(4)]))
    recipe = {"name": "tiny", "out_dir": str(tmp_path / "run"), "model": {"source": str(tmp_path / "m")},
              "distill": {"data": str(data), "max_new_tokens": 6, "head_layers": 2,
                          "train": {"batch_size": 2, "max_epochs": 1, "lr": 1e-3, "ttt_steps": 2}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["distill", str(path)]) == 0
    out = tmp_path / "run" / "distill"
    assert (out / "target" / "head.safetensors").is_file() and (out / "recipe.yaml").is_file()
    assert load_head(out / "target" / "head.safetensors", load_model(str(tmp_path / "m")).model).cfg.n_layers == 2
    recipe["distill"]["data"] = str(tmp_path / "missing.json")
    path.write_text(yaml.safe_dump(recipe))
    assert main(["distill", str(path)]) == 2  # clear error, before any model loads
