"""The training-lever sweep: variant parsing (bad keys named before any work), the data cuts, and a
real run on a tiny model's cached distill features (train, diagnose, table, skip on rerun)."""
import json

import pytest
import yaml

from polybasic.drafters import sweep as S
from polybasic.errors import ConfigError


def test_variants_parse_into_train_head_and_data_overrides():
    v = S.parse_variant("lr:train.lr=0.01,train.max_epochs=4,head.n_layers=2,data.fraction=0.5")
    assert (v.name, v.train, v.head, v.data) == ("lr", {"lr": 0.01, "max_epochs": 4}, {"n_layers": 2},
                                                 {"fraction": 0.5})
    assert S.parse_variant("base:") == S.SweepVariant("base", {}, {}, {})
    for bad, word in [("nocolon", "NAME:KEY=VALUE"), ("x:lr=0.1", "train.*"), ("x:data.rows=3", "data.rows")]:
        with pytest.raises(ConfigError, match=word):
            S.parse_variant(bad)


def _run(tmp_path):
    """A tiny model's distill run (real answers, features, head) and its recipe path."""
    from polybasic.pipelines.run import run_recipe
    from tests.helpers import tiny_hf_folder

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    (tmp_path / "d.json").write_text(json.dumps(
        [{"instruction": " ".join(f"w{(i * 7 + j) % 50}" for j in range(6)), "input": "",
          "output": " ".join(f"w{(i * 3 + j) % 50}" for j in range(12))} for i in range(10)]))
    recipe = {"name": "tiny", "out_dir": str(tmp_path / "run"), "stages": ["distill"],
              "model": {"source": str(tmp_path / "m")},
              "distill": {"data": "d.json", "limit": 6, "max_new_tokens": 6, "gen_batch_size": 4,
                          "draft_vocab_size": 0, "train": {"batch_size": 4, "max_epochs": 1, "lr": 1e-3,
                                                           "compile_loss": False}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_recipe(str(path))
    return path


def test_a_sweep_trains_each_variant_on_the_cached_features_and_skips_finished_ones(tmp_path, capsys):
    recipe = _run(tmp_path)
    out = tmp_path / "sweep"
    argv = ["--recipe", str(recipe), "--out", str(out), "--prompts", "3", "--max-new-tokens", "8",
            "--variant", "base:", "--variant", "half:data.fraction=0.5,train.lr=0.003"]
    assert S.main(argv) == 0
    base, half = (json.loads((out / n / "train.json").read_text())["value"] for n in ("base", "half"))
    assert base["sequences"] == 12 and half["sequences"] == 6  # 6 answers + 6 references; half of them
    diag = json.loads((out / "half" / "result.json").read_text())["value"]["draft_start"]
    assert diag["sequences"] == 3 and 0 <= diag["step1"] <= 1
    table = (out / "sweep.md").read_text()
    assert "| half | train.lr=0.003, data.fraction=0.5 | 6 |" in table and "| base | (recipe) | 12 |" in table
    stamp = (out / "base" / "head.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert S.main(argv) == 0  # finished: nothing trained again
    assert (out / "base" / "head.safetensors").stat().st_mtime_ns == stamp
    assert "training on" not in capsys.readouterr().out


def test_a_bad_field_is_named_before_any_training(tmp_path):
    recipe = _run(tmp_path)
    with pytest.raises(ConfigError, match="--variant x.*learning_rate"):
        S.main(["--recipe", str(recipe), "--out", str(tmp_path / "s"), "--variant", "x:train.learning_rate=1"])
    assert not (tmp_path / "s").exists()
