"""The training-lever sweep: variant parsing (bad keys named before any work), the data cuts, and a
real run on a tiny model's cached distill features (train, diagnose, table, skip on rerun)."""
import json

import pytest
import yaml

from experiments import sweep as S
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


def test_bench_measures_each_head_on_spec_bench_once_per_temperature(tmp_path, monkeypatch):
    """--bench: each head's 2-level chain through the real `polybasic bench` flags, tau per temperature
    and per category in the table, cached per head and settings."""
    from experiments import ablation as A
    from polybasic.cli import build_parser

    recipe = _run(tmp_path)
    calls = []

    def fake_bench(model, head, t, spec, json_path):
        argv = A.bench_argv(model, head, t, spec, json_path)
        a = build_parser().parse_args(argv[3:])  # the flags `polybasic bench` really takes
        assert (a.methods, a.draft_tokens, a.per_category, a.max_new_tokens) == (f"chain:eagle:{head}", 5, 1, 16)
        calls.append((head.split("/")[-2], t))
        return A.bench_summary({"config": {"prompts": 2}, "methods": {f"chain:eagle:{head}": {
            "tau": 1.25 + t, "per_category": {"qa": {"tau": 1.5 + t}, "rag": {"tau": 1.0}}}}})

    monkeypatch.setattr(A, "run_bench", fake_bench)
    out = tmp_path / "sweep"
    argv = ["--recipe", str(recipe), "--out", str(out), "--prompts", "2", "--max-new-tokens", "6",
            "--variant", "base:", "--variant", "lr:train.lr=0.003", "--bench", "0,1", "--bench-tokens", "16"]
    assert S.main(argv) == 0
    assert calls == [("base", 0.0), ("base", 1.0), ("lr", 0.0), ("lr", 1.0)]
    table = (out / "sweep.md").read_text()
    assert "Spec-Bench tau T=0 | Spec-Bench tau T=1 |" in table
    assert "| 1.250 | 2.250 |" in table
    assert "## tau per Spec-Bench category, T=1" in table and "| lr | 2.500 | 1.000 |" in table
    assert S.main(argv) == 0 and len(calls) == 4  # measured once: a rerun reads the cache
    with pytest.raises(ConfigError, match="--bench"):
        S.main([*argv[:-4], "--bench", "hot"])


def test_a_head_for_a_target_on_its_gguf_codes_takes_the_models_shape(tmp_path):
    """A recipe whose target is 'NAME@w4a8' (its GGUF's codes on the w4a8 kernel) sweeps heads of NAME's shape."""
    from polybasic.config import load_recipe
    from tests.helpers import tiny_hf_folder

    tiny_hf_folder(tmp_path / "m", vocab=64, hidden=64)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "out_dir": str(tmp_path / "run"), "stages": ["distill"],
                                    "model": {"source": f"{tmp_path / 'm'}@w4a8"}, "distill": {"draft_vocab_size": 0}}))
    head, _ = S.configs(load_recipe(str(path)), S.parse_variant("base:"))
    assert (head.dim, head.vocab_size) == (64, 64)
