"""`polybasic run`: every stage of a tiny recipe ends in a bundle that loads from a fresh process
and decodes exactly as the chain it was planned from; finished stages are skipped; a run killed in
the middle of stages resumes to the same manifest, timings aside."""
import json
import subprocess
import sys

import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from polybasic.cli import main
from polybasic.planner.replan import reprofile
from polybasic.runtime import bundle as B
from tests.helpers import tiny_hf_folder
from tests.pipelines.test_resume import assert_equal_tree, partials, run_killed


def _recipe(tmp_path, **over):
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": " ".join(f"w{(i * 7 + j) % 50}" for j in range(6)), "input": "",
                                 "output": " ".join(f"w{(i * 3 + j) % 50}" for j in range(12))}
                                for i in range(24)]))
    qs = tmp_path / "q.jsonl"
    qs.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w{i + 1} w{i} w{i + 1}"]})
                          + "\n" for i in range(2)))
    r = {"name": "tiny", "out_dir": str(tmp_path / "run"), "model": {"source": str(tmp_path / "m")},
         "quantize": {"calib": {"method": "affinequant", "w_bits": 4, "a_bits": 4, "group_size": 32,
                                "n_samples": 2, "seq_len": 16, "epochs": 1, "batch_size": 1},
                      "data": str(data), "holdout": 4, "eval_seq_len": 16, "eval_windows": 2,
                      "schemes": ["w4a4"], "methods": ["affinequant"], "kernel": "int4pack",
                      "exec_dtype": "bfloat16", "latency_tokens": [1, 2], "latency_context": 8, "latency_reps": 1},
         "distill": {"data": str(data), "limit": 20, "max_new_tokens": 6, "gen_batch_size": 8,
                     "gen_dtype": "float32", "feature_dtype": "float32", "drafters": ["target", "quantized"],
                     "train": {"batch_size": 4, "max_epochs": 1, "lr": 1e-3}},
         "profile": {"levels": ["quantized", "eagle:target", "eagle:quantized", "ngram"], "data": str(data),
                     "prompts": 3, "max_new_tokens": 8, "k": 3, "context": 16, "reps": 1},
         "plan": {"k_values": [1, 2, 3], "thresholds": [2, 4], "max_levels": 3, "new_tokens": 8},
         "bench": {"questions": str(qs), "per_category": 2, "max_new_tokens": 8, "warmup": 0}}
    for section, fields in over.items():
        r[section].update(fields)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def test_run_ends_in_a_bundle_that_decodes_as_planned(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    assert main(["run", str(recipe)]) == 0
    out = tmp_path / "run"
    text = capsys.readouterr().out
    for stage in ("quantize", "distill", "profile", "plan", "export", "bench"):
        assert f"[{stage}] done" in text, stage
    plan = json.loads((out / "plan.json").read_text())
    profile = json.loads((out / "profile.json").read_text())
    assert {p["drafter"] for p in profile["pairs"]} == {"quantized", "eagle:target", "eagle:quantized", "ngram"}
    assert "Thm 3.2 exact" in (out / "plan.md").read_text()
    best = plan["rows"][0]
    m = B.check_bundle(out / "bundle")
    assert (m.decoding.k, list(m.decoding.thresholds or ())) == (best["k"], best["thresholds"])
    assert m.plan["predicted_speedup"] == best["speedup"] and m.profile == profile
    doc = json.loads((out / "bench" / "bench.json").read_text())
    assert doc["methods"]["chain"]["predicted_speedup"] == best["speedup"]
    assert doc["methods"]["chain"]["identical_to_vanilla"] == "2/2"
    # export -> load decodes exactly as the chain the plan named, with the same k and thresholds
    from polybasic.models import load_model
    from polybasic.pipelines.profile import chain_spelling
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.generate import generate_tokens

    lm = load_model(str(tmp_path / "m"))
    planned = Chain(parse_chain(chain_spelling(best["chain"], out), lm), k=best["k"],
                    thresholds=best["thresholds"] or None)
    prompt = [5, 9, 5, 9, 5]
    want, _ = planned.generate(prompt, 16)
    assert list(B.load(out / "bundle").tokens(prompt, 16)) == want == list(generate_tokens(lm.model, prompt, 16))
    # re-measured and re-planned here among the bundle's own levels, still the target's greedy output
    dec = B.load(out / "bundle")
    reprofile(dec)
    assert dec.manifest.plan["reprofiled"] and dec.manifest.plan["levels"][0] == "target"
    assert set(dec.manifest.plan["levels"]) <= set(best["chain"]) and dec.predicted_speedup > 0
    assert list(dec.tokens(prompt, 16)) == want
    # a fresh process loads it too
    r = subprocess.run([sys.executable, "-m", "polybasic.cli", "generate", "--bundle", str(out / "bundle"),
                        "--prompt", "w1 w2", "--max-new-tokens", "6", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["new_tokens"] >= 1, r.stderr
    # nothing changed: every stage is skipped; a changed plan section re-runs plan and what follows
    assert main(["run", str(recipe)]) == 0
    assert capsys.readouterr().out.count("skipped: its outputs match") == 6
    r = yaml.safe_load(recipe.read_text())
    r["plan"]["new_tokens"] = 16
    recipe.write_text(yaml.safe_dump(r))
    assert main(["run", str(recipe)]) == 0
    text = capsys.readouterr().out
    assert text.count("skipped") == 3 and "[plan] done" in text and "[bench] done" in text
    # a stage that runs again though its inputs did not change (its record removed: it re-measures
    # what is not cached) makes the stages after it run again too
    (out / ".stages" / "profile.json").unlink()
    assert main(["run", str(recipe)]) == 0
    text = capsys.readouterr().out
    assert text.count("skipped") == 2 and "[profile] done" in text and "[plan] done" in text


def _comparable(manifest: dict) -> dict:
    """A manifest without what depends on the clock (timings and the predictions made from them),
    and without the level files' sha256: safetensors writes its metadata in hash-map order, so equal
    files can differ in bytes (their tensors and metadata are compared instead)."""
    m = json.loads(json.dumps(manifest))
    for key in ("created", "machine"):
        m.pop(key)
    for f in m["files"].values():
        f.pop("sha256")
        f.pop("bytes")
    for lv in m["profile"]["levels"]:
        lv.pop("cost")
    for p in m["profile"]["pairs"]:
        p.pop("overhead_ms")
    m["plan"] = {k: v for k, v in m["plan"].items() if not k.startswith("predicted")}
    return m


def test_a_killed_run_resumes_to_the_same_manifest(tmp_path, capsys):
    # one candidate chain (target <- its head, k = 3), so the plan does not depend on the clock
    recipe = _recipe(tmp_path, distill={"drafters": ["target"]}, profile={"levels": ["eagle:target"]},
                     plan={"k_values": [3], "max_levels": 2}, bench={"per_category": 1})
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert main(["run", str(recipe), "--out", str(ref)]) == 0
    argv = ["run", str(recipe), "--out", str(run)]
    for point in ("calibrate.block:1", "train.checkpoint:1", "profile.measure:1", "write/bundle"):
        run_killed(argv, point, tmp_path)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "[quantize] skipped" in text and "[export] done" in text
    assert not partials(run)
    a, b = (json.loads((d / "bundle" / "manifest.json").read_text()) for d in (ref, run))
    assert _comparable(a) == _comparable(b)
    for rel in a["files"]:
        assert_equal_tree(load_file(ref / "bundle" / rel), load_file(run / "bundle" / rel), rel)
        with safe_open(str(ref / "bundle" / rel), "pt") as fa, safe_open(str(run / "bundle" / rel), "pt") as fb:
            assert fa.metadata() == fb.metadata()


def test_run_checks_every_stage_before_loading(tmp_path):
    recipe = _recipe(tmp_path, profile={"levels": ["eagle:nowhere.safetensors"]})
    r = subprocess.run([sys.executable, "-m", "polybasic.cli", "run", str(recipe)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "profile.levels: 'eagle:nowhere.safetensors'" in r.stderr and not (tmp_path / "run").exists()
    overlap = _recipe(tmp_path, distill={"limit": 24})
    with pytest.raises(Exception, match="among the distill stage's first 24 training records"):
        from polybasic.pipelines.run import run_recipe

        run_recipe(overlap)
    assert not (tmp_path / "run").exists()


def test_a_profile_on_compiled_steps_plans_against_compiled_plain_decoding(tmp_path, monkeypatch):
    """profile.compile: every level is timed on compiled steps (the target's plain decode step too, the baseline), the
    profile and the bundle's plan say so, a tree drafter is measured at each of profile.measured_k_values, and the
    bundle still decodes the target's own greedy tokens."""
    import polybasic.pipelines.profile as stage
    from polybasic.runtime.generate import generate_tokens

    path = _recipe(tmp_path, profile={"levels": ["ngram", "ngram:3/2"], "compile": True, "measured_k_values": [2, 3]})
    r = yaml.safe_load(path.read_text())
    r["stages"] = ["profile", "plan", "export"]
    path.write_text(yaml.safe_dump(r))
    compiled = []

    def spy(levels, *a, **kw):
        seconds = stage_compile(levels, *a, **kw)
        compiled.append([getattr(getattr(lv, "model", None), "_static", None) is not None for lv in levels])
        return seconds

    stage_compile = stage.compile_levels
    monkeypatch.setattr(stage, "compile_levels", spy)
    assert main(["run", str(path)]) == 0
    assert compiled == [[True, False, False]]  # the target's steps compiled before any measurement (its tree steps
    # too: it verifies the n-gram's trees); the n-grams have none
    out = tmp_path / "run"
    profile = json.loads((out / "profile.json").read_text())
    assert profile["compiled"] is True
    assert sorted(p["k"] for p in profile["pairs"] if p["drafter"] == "ngram:3/2") == [2, 3]  # a tree, per k
    m = B.check_bundle(out / "bundle")
    assert m.planned_compiled and m.plan["compiled"] is True
    decoder = B.load(out / "bundle")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    assert decoder.chain.generate(prompt, 10)[0] == list(generate_tokens(decoder.target.model, prompt, 10,
                                                                         eos=decoder.chain.eos))
