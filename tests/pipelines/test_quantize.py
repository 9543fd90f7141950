"""The `quantize` stage end to end on a tiny local model folder, and recipe errors."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from polybasic.config import Recipe, from_dict, load_recipe
from polybasic.errors import ConfigError
from polybasic.pipelines.run import run_recipe
from tests.helpers import tiny_hf_folder


def _data(path, n=24):
    recs = [{"instruction": " ".join(f"w{(i * 7 + j) % 50}" for j in range(12)), "input": "",
             "output": " ".join(f"w{(i * 3 + j) % 50}" for j in range(20))} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in recs))
    return path


def _recipe(tmp_path):
    model = tmp_path / "tiny"
    tiny_hf_folder(model, vocab=64, hidden=64, heads=4, kv_heads=2, init_std=0.2)
    r = {"name": "tiny", "out_dir": str(tmp_path / "out"), "model": {"source": str(model)},
         "quantize": {"calib": {"method": "affinequant", "w_bits": 4, "a_bits": 4, "group_size": 32,
                                "n_samples": 4, "seq_len": 32, "epochs": 2, "batch_size": 2},
                      "data": str(_data(tmp_path / "d.jsonl")), "holdout": 6, "eval_seq_len": 32,
                      "eval_windows": 4, "schemes": ["w4a4", "w4a16"], "methods": ["rtn", "affinequant"],
                      "kernel": "dequant", "exec_dtype": "float32", "latency_tokens": [1, 4],
                      "latency_context": 8, "latency_reps": 2}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def test_quantize_stage_writes_model_report_recipe_and_resumes(tmp_path, monkeypatch):
    path = _recipe(tmp_path)
    run_recipe(str(path), only=("quantize",))
    out = tmp_path / "out"
    for f in ("model.safetensors", "recipe.yaml", "report.md", "report.json"):
        assert (out / f).is_file(), f
    rep = json.loads((out / "report.json").read_text())
    assert {(r["scheme"], r["method"]) for r in rep["rows"]} == {
        ("w4a4", "rtn"), ("w4a4", "affinequant"), ("w4a16", "rtn"), ("w4a16", "affinequant")}
    assert set(rep["latency_ms"]) >= {"fp32", "bf16"}
    assert load_recipe(out / "recipe.yaml").quantize.calib.epochs == 2
    from polybasic.models.loader import load_model
    from polybasic.quant import load_quantized

    args = load_model(str(tmp_path / "tiny")).args
    from polybasic.models.decoder import Transformer

    qm = load_quantized(out / "model.safetensors", lambda: Transformer(args))
    assert len([n for n in qm.state_dict() if n.endswith("qweight")]) == 2 * 4
    assert rep["main"]["deployed_ppl"] > 0 and 0 <= rep["main"]["deployed_top1_agree"] <= 1
    # resume: every cell is done, so no block is trained again
    import polybasic.quant.calibrate as C

    monkeypatch.setattr(C, "_train_block", lambda *a, **k: pytest.fail("retrained a saved block"))
    record = out / ".stages" / "quantize.json"
    before = record.read_text()
    run_recipe(str(path), str(out), only=("quantize",))  # the run loop skips it: inputs unchanged
    assert record.read_text() == before
    record.unlink()  # forgotten: the stage runs again and reuses every saved block
    run_recipe(str(path), str(out), only=("quantize",))
    assert json.loads(record.read_text())["fingerprint"] == json.loads(before)["fingerprint"]


def test_recipe_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"quantize\.calib\.epochs: expected int"):
        from_dict(Recipe, {"quantize": {"calib": {"epochs": "two"}}})
    with pytest.raises(ConfigError, match=r"quantize\.schemes\[1\]"):
        from_dict(Recipe, {"quantize": {"schemes": ["w4a4", "w3x"]}})
    with pytest.raises(ConfigError, match=r"quantize\.calib: CalibrationConfig\.lr_clip"):
        from_dict(Recipe, {"quantize": {"calib": {"lr_clip": -1.0}}})
    with pytest.raises(ConfigError, match=r"quantize: unknown field\(s\) \['epochs'\]"):
        from_dict(Recipe, {"quantize": {"epochs": 3}})
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"quantize": {"data": str(tmp_path / "missing.json")}, "model": {"source": "x"}}))
    with pytest.raises(FileNotFoundError, match=r"quantize\.data"):
        run_recipe(str(p), str(tmp_path / "o"), only=("quantize",))
    assert not (tmp_path / "o").exists()


def test_quantized_lm_head_option(tmp_path):
    path = _recipe(tmp_path)
    r = yaml.safe_load(path.read_text())
    r["quantize"].update(quantize_lm_head=True, schemes=["w4a4"], methods=["rtn"],
                         calib={**r["quantize"]["calib"], "method": "rtn"})
    path.write_text(yaml.safe_dump(r))
    run_recipe(str(path), only=("quantize",))
    from polybasic.models.decoder import Transformer
    from polybasic.models.loader import load_model
    from polybasic.quant import load_quantized
    from polybasic.quant.linear import QuantLinear

    lm = load_model(str(tmp_path / "tiny"))
    qm = load_quantized(tmp_path / "out" / "model.safetensors", lambda: Transformer(lm.args))
    assert isinstance(qm.output, QuantLinear)
    assert torch.equal(qm.tok_embeddings.weight, lm.model.tok_embeddings.weight)  # embedding stays float
    assert "LM head quantized too" in (tmp_path / "out" / "report.md").read_text()


def test_siblings_are_quantized_alike_and_become_chain_levels(tmp_path):
    """quantize.siblings: a smaller model with the target's tokenizer is quantized with the same
    settings into siblings/<name>/, the profile names it `quantized:<name>`, and a chain through it
    stays greedy-exact. latency_reps 0 skips the latency table."""
    from polybasic.models.loader import load_model
    from polybasic.pipelines.profile import own_level
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.generate import generate_tokens

    path = _recipe(tmp_path)
    small = tmp_path / "small"
    tiny_hf_folder(small, vocab=64, hidden=32, heads=2, kv_heads=1, init_std=0.2)
    r = yaml.safe_load(path.read_text())
    r["quantize"].update(schemes=["w4a16"], methods=["rtn"], calib={**r["quantize"]["calib"], "method": "rtn",
                                                                    "a_bits": 16},
                         latency_reps=0, siblings=[str(small)])
    path.write_text(yaml.safe_dump(r))
    run_recipe(str(path), only=("quantize",))
    out = tmp_path / "out"
    copy = Path(own_level(f"quantized:{small}", out))
    assert copy.is_file() and copy.parent.parent == out / "siblings"
    assert json.loads((copy.parent / "report.json").read_text())["model"] == str(small)
    assert json.loads((out / "report.json").read_text())["latency_ms"] is None
    assert "No latency table" in (out / "report.md").read_text()
    target = load_model(str(tmp_path / "tiny"))
    levels = parse_chain(f"{copy}+ngram:2", target)
    assert levels[1].model.args.dim == 32  # built from the sibling's own config
    prompt = [5, 6, 7, 8, 5, 6, 7]
    assert Chain(levels, k=3).generate(prompt, 20)[0] == list(generate_tokens(target.model, prompt, 20))


def test_sibling_names_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"quantize\.siblings\[0\]"):
        from_dict(Recipe, {"quantize": {"siblings": [""]}})
    with pytest.raises(ConfigError, match=r"quantize\.latency_reps"):
        from_dict(Recipe, {"quantize": {"latency_reps": -1}})
    r = from_dict(Recipe, {"profile": {"levels": ["quantized:other"]}})
    from polybasic.pipelines.profile import candidates

    with pytest.raises(ConfigError, match=r"quantize\.siblings"):
        candidates(r, tmp_path)
