"""The drafter-quality ablation driver: derived recipes (overrides applied, every recipe validated before any
work), the ablation.md table from results dicts, resume (finished variants skipped), and the real
train + diagnose glue on a tiny model (the bench subprocess replaced; its command line is parsed
by the real `polybasic bench` parser)."""
import json
import re
from pathlib import Path

import pytest
import yaml

from experiments import ablation as A
from polybasic.config import load_recipe
from polybasic.errors import ConfigError


def _base(tmp_path, source="smollm2-135m", n=12, limit=6, **distill) -> Path:
    """A base recipe whose relative data path must survive the move to OUT/<variant>/recipe.yaml.
    Nothing here loads the model unless a test trains."""
    (tmp_path / "d.json").write_text(json.dumps(
        [{"instruction": " ".join(f"w{(i * 7 + j) % 50}" for j in range(6)), "input": "",
          "output": " ".join(f"w{(i * 3 + j) % 50}" for j in range(12))} for i in range(n)]))
    r = {"name": "tiny", "out_dir": "elsewhere", "stages": ["quantize", "distill", "bench"],
         "model": {"source": source},
         "distill": {"data": "d.json", "limit": limit, "max_new_tokens": 6, "gen_batch_size": 4,
                     "drafters": ["target", "quantized"], "draft_vocab_size": 16,
                     "train": {"batch_size": 4, "max_epochs": 1, "lr": 1e-3}, **distill}}
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _spec(tmp_path, variants, **kw) -> A.AblationSpec:
    return A.AblationSpec(recipe=str(_base(tmp_path)), out=str(tmp_path / "out"), variants=variants,
                          prompts=3, command="python -m experiments.ablation ...", **kw)


class Fakes:
    """train_variant / measure_variant stand-ins that record their calls; `fail` names a variant
    whose measurement raises (an interrupted run)."""

    def __init__(self, fail=None):
        self.trained, self.measured, self.fail = [], [], fail

    def train(self, p):
        self.trained.append(p.variant.name)
        assert p.recipe_path.is_file()  # the derived recipe is written before training
        return {"run_id": f"run-{p.variant.name}", "wall_s": 10.0, "partial": False, "global_step": 4,
                "sequences": 8, "head": str(p.folder / "head.safetensors")}

    def measure(self, spec, p, train, target, say=print):
        if p.variant.name == self.fail:
            raise KeyboardInterrupt
        self.measured.append(p.variant.name)
        tau = 2.0 + 0.25 * len(self.measured)
        return {"diagnose": {"draft_start": {"step1": 0.5, "mean_accepted_length": tau}, "all": {"step1": 0.6}},
                "bench": {A.temp_label(t): {"tau": tau - t, "per_category": {"qa": tau, "math": tau - 1}}
                          for t in spec.temperatures}}

    def install(self, monkeypatch):
        monkeypatch.setattr(A, "train_variant", self.train)
        monkeypatch.setattr(A, "measure_variant", self.measure)
        return self


# (1) derived recipes -------------------------------------------------------------------------

def test_derived_recipes_apply_overrides_and_are_validated_before_any_work(tmp_path, monkeypatch):
    base = A.base_tree(_base(tmp_path))
    variants = A.default_variants(base, best="references-false,distill.train.regress=postnorm")
    names = [v.name for v in variants]
    assert names == ["baseline", "dtype-float32", "references-false", "prompt_loss-true", "regress-postnorm",
                     "regress-none", "feature_residual-false", "draft_vocab-0", "best"]
    spec = _spec(tmp_path, variants)
    planned = {p.variant.name: p for p in A.plan(spec)}
    assert not (tmp_path / "out").exists()  # plan writes nothing
    for name, p in planned.items():
        t = p.tree
        assert t["stages"] == ["distill"] and t["distill"]["drafters"] == ["target"]  # target's head only
        assert t["out_dir"] == str((tmp_path / "out" / name).absolute())
        assert t["distill"]["data"]["path"] == str(tmp_path / "d.json")  # absolute: the recipe moves
        assert (t["distill"]["limit"], t["distill"]["train"]["max_epochs"]) == (6, 1)  # the fixed budget
    best = planned["best"].recipe.distill
    assert best.references is False and best.train.regress == "postnorm" and best.draft_vocab_size == 16
    dt = planned["dtype-float32"].recipe.distill
    assert dt.gen_dtype == dt.feature_dtype == "float32"
    assert planned["draft_vocab-0"].recipe.distill.draft_vocab_size == 0
    base_d = planned["baseline"].recipe.distill
    assert (base_d.references, base_d.train.regress, base_d.train.prompt_loss) == (True, "prenorm", False)
    A.write_recipes(list(planned.values()))
    again = load_recipe(tmp_path / "out" / "best" / "recipe.yaml")  # what `polybasic run` would read
    assert again.distill.train.regress == "postnorm" and again.distill.data.path == str(tmp_path / "d.json")

    # a bad key, a bad value, a budget key: ConfigError naming it, before any training or any file
    fakes = Fakes().install(monkeypatch)
    bad = [(A.Variant("typo", {"distill.train.regres": "postnorm"}, "--best"), r"--best: distill\.train\.regres is "
            r"not a recipe field.*'regress'"),
           (A.Variant("dt", {"distill.gen_dtype": "float8"}), r"variant dt: .*distill\.gen_dtype"),
           (A.Variant("big", {"distill.limit": 999}, "--extra big"), r"--extra big: distill\.limit is part of the "
            r"fixed training budget"),
           (A.Variant("tgt", {"model.dtype": "bfloat16"}), r"variant tgt: model\.dtype is not a drafter lever")]
    for i, (v, match) in enumerate(bad):
        out = tmp_path / f"bad{i}"
        with pytest.raises(ConfigError, match=match):
            A.run_ablation(A.AblationSpec(spec.recipe, str(out), [A.Variant("baseline", {}), v], prompts=3),
                           say=lambda s: None)
        assert not out.exists()
    assert fakes.trained == [] and fakes.measured == []


def test_cli_errors_name_the_flag(tmp_path, capsys):
    recipe = str(_base(tmp_path))
    cases = [(["--variants", "baseline,nope"], "--variants: unknown variant 'nope'"),
             (["--variants", "best"], r"--variants: unknown variant 'best' \(pass --best"),
             (["--best", "distill.train.regres=none"], "--best: distill.train.regres is not a recipe field"),
             (["--best", "no-such-lever"], "--best: 'no-such-lever' is neither KEY=VALUE nor a lever variant"),
             (["--extra", "fp32"], "--extra: 'fp32' is not NAME:KEY=VALUE"),
             (["--budget", "distill.limit=8"], "--prompts: the last 20 of the 12 prompts"),
             (["--prompts", "7"], "--prompts: the last 7 of the 12 prompts .* overlap the 6 training prompts"),
             (["--temperatures", "0,hot"], "--temperatures"),
             (["--k", "0"], "--k: must be >= 1")]
    for extra, message in cases:
        assert A.main(["--recipe", recipe, "--out", str(tmp_path / "o"), "--dry-run", *extra]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), (extra, err)
    assert A.main(["--recipe", recipe, "--out", str(tmp_path / "o"), "--prompts", "6", "--dry-run",
                   "--variants", "baseline,regress-none", "--budget", "distill.train.max_steps=3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"baseline: - -> {tmp_path / 'o' / 'baseline' / 'recipe.yaml'}",
        f"regress-none: distill.train.regress=none -> {tmp_path / 'o' / 'regress-none' / 'recipe.yaml'}"]
    assert not (tmp_path / "o").exists()


def test_parse_overrides_reads_yaml_values():
    assert A.parse_overrides("distill.references=false, distill.train.lr=1e-3,distill.drafters=[target, quantized]",
                             "--best") == {"distill.references": False, "distill.train.lr": "1e-3",
                                           "distill.drafters": ["target", "quantized"]}
    tree = {"distill": {"train": {"lr": 3e-4}}}
    assert A.apply_overrides(tree, {"distill.train.lr": "1e-3"}, "--best")["distill"]["train"]["lr"] == 1e-3
    assert tree["distill"]["train"]["lr"] == 3e-4  # a copy


# (2) the table -------------------------------------------------------------------------------

def _result(name, wall, step1, walk, t0, t1, cats, partial=False, steps=40):
    return {"variant": name, "train": {"wall_s": wall, "partial": partial, "global_step": steps},
            "diagnose": {"draft_start": {"step1": step1, "mean_accepted_length": walk}},
            "bench": {"T=0": {"tau": t0, "per_category": cats}, "T=1": {"tau": t1, "per_category": cats}}}


def test_markdown_rows_from_results():
    variants = [A.Variant("baseline", {}), A.Variant("references-false", {"distill.references": False}),
                A.Variant("best", {"distill.references": False, "distill.train.regress": "postnorm"}, "--best")]
    results = {"baseline": _result("baseline", 12.34, 0.6, 2.5, 2.0, 1.5, {"qa": 2.1, "math": 1.9}),
               "references-false": _result("references-false", 8.0, 0.65, 2.75, 2.25, 1.25, {"qa": 2.5},
                                           partial=True, steps=20),
               "best": None}
    md = A.render_markdown("python -m experiments.ablation --recipe r.yaml", ["Setting line."], variants,
                           results, (0.0, 1.0))
    lines = md.splitlines()
    assert lines[:5] == ["# Drafter-quality ablation", "", "```",
                         "python -m experiments.ablation --recipe r.yaml", "```"]
    assert "Setting line." in lines
    i = lines.index("| variant | overrides | train s | steps | step-1 @ draft starts | walk tau | tau T=0 | "
                    "vs baseline T=0 | tau T=1 | vs baseline T=1 |")
    assert lines[i + 1] == "|" + "---|" * 10
    assert lines[i + 2] == "| baseline | - | 12.3 | 40 | 0.600 | 2.500 | 2.000 | - | 1.500 | - |"
    assert lines[i + 3] == ("| references-false | distill.references=false | 8.0* | 20 | 0.650 | 2.750 | 2.250 | "
                            "+0.250 | 1.250 | -0.250 |")
    assert lines[i + 4] == ("| best | distill.references=false, distill.train.regress=postnorm | pending |"
                            " | | | | | | |")
    assert lines[i + 4].count("|") == lines[i + 2].count("|")
    j = lines.index("## tau per Spec-Bench category, T=0 (greedy)")
    assert lines[j + 2:j + 6] == ["| variant | qa | math |", "|---|---|---|", "| baseline | 2.100 | 1.900 |",
                                  "| references-false | 2.500 | - |"]
    assert "## tau per Spec-Bench category, T=1" in lines


# (3) resume ----------------------------------------------------------------------------------

def test_finished_variants_are_skipped(tmp_path, monkeypatch):
    variants = [A.Variant("baseline", {}), A.Variant("references-false", {"distill.references": False}),
                A.Variant("regress-none", {"distill.train.regress": "none"})]
    spec = _spec(tmp_path, variants)
    out = tmp_path / "out"
    first = Fakes(fail="references-false").install(monkeypatch)
    with pytest.raises(KeyboardInterrupt):  # killed while measuring the second variant
        A.run_ablation(spec, say=lambda s: None)
    assert first.trained == ["baseline", "references-false"] and first.measured == ["baseline"]
    assert (out / "baseline" / "results.json").is_file() and not (out / "references-false" / "results.json").exists()
    md = (out / "ablation.md").read_text()
    assert "| baseline | - | 10.0 |" in md and "| references-false | distill.references=false | pending |" in md

    second = Fakes().install(monkeypatch)
    got = A.run_ablation(spec, say=lambda s: None)
    assert second.trained == second.measured == ["references-false", "regress-none"]  # baseline skipped
    assert got["baseline"]["bench"]["T=0"]["tau"] == 2.25  # the first run's, read back
    assert got["regress-none"]["train"]["run_id"] == "run-regress-none"
    saved = json.loads((out / "regress-none" / "results.json").read_text())
    assert saved["overrides"] == {"distill.train.regress": "none"} and saved["diagnose"]["draft_start"]["step1"] == 0.5
    assert "pending" not in (out / "ablation.md").read_text()

    third = Fakes().install(monkeypatch)
    A.run_ablation(spec, say=lambda s: None)
    assert third.trained == [] and third.measured == []  # everything done: nothing runs

    spec.prompts = 4  # other measurement settings: every variant measured again (training resumes in the run loop)
    fourth = Fakes().install(monkeypatch)
    A.run_ablation(spec, say=lambda s: None)
    assert fourth.measured == ["baseline", "references-false", "regress-none"]


# the real glue on a tiny model ------------------------------------------------------------------

def test_train_and_diagnose_on_a_tiny_model(tmp_path, monkeypatch):
    from polybasic.cli import build_parser
    from tests.helpers import tiny_hf_folder

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    spec = A.AblationSpec(recipe=str(_base(tmp_path, source=str(tmp_path / "m"), draft_vocab_size=0)),
                          out=str(tmp_path / "out"), variants=[A.Variant("baseline", {})], prompts=3,
                          max_new_tokens=8, per_category=1)
    benches = []

    def fake_bench(model, head, t, spec, json_path):
        argv = A.bench_argv(model, head, t, spec, json_path)
        a = build_parser().parse_args(argv[3:])  # the real `polybasic bench` flags
        assert (a.methods, a.draft_tokens, a.temperature, a.per_category) == (f"chain:eagle:{head}", 5, t, 1)
        benches.append(t)
        return A.bench_summary({"config": {"prompts": 2}, "methods": {
            "vanilla": {"tau": None, "per_category": {"qa": {"tau": None}}},
            f"chain:eagle:{head}": {"tau": 1.5 + t, "accept_len": 1.6, "identical_to_vanilla": "2/2",
                                    "per_category": {"qa": {"tau": 1.5 + t}}}}})

    monkeypatch.setattr(A, "run_bench", fake_bench)
    r = A.run_ablation(spec, say=lambda s: None)["baseline"]
    assert r["train"]["global_step"] == 3 and r["train"]["sequences"] == 12  # 6 answers + 6 references, batch 4
    assert r["train"]["wall_s"] > 0 and r["train"]["partial"] is False
    ds = r["diagnose"]["draft_start"]
    assert ds["sequences"] == 3 and 0 <= ds["step1"] <= 1 and ds["mean_accepted_length"] >= 1
    assert r["bench"] == {"T=0": {"method": r["bench"]["T=0"]["method"], "tau": 1.5, "accept_len": 1.6,
                                  "identical_to_vanilla": "2/2", "speedup": None, "prompts": 2,
                                  "per_category": {"qa": 1.5}},
                          "T=1": {**r["bench"]["T=0"], "tau": 2.5, "per_category": {"qa": 2.5}}}
    assert benches == [0.0, 1.0]
    held = json.loads((tmp_path / "out" / "heldout.json").read_text())["value"]
    assert len(held) == 3  # the last 3 records' answers, shared by every variant


def test_variants_with_the_same_data_settings_share_answers_and_features(tmp_path, monkeypatch):
    """A lever that only changes training reuses the baseline's answers and feature shards (hard links,
    as the distill stage's own files); one that changes the features reuses the answers only; one that
    changes the data makes its own."""
    from tests.helpers import tiny_hf_folder

    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    variants = [A.Variant("baseline", {}), A.Variant("regress-none", {"distill.train.regress": "none"}),
                A.Variant("layers", {"distill.feature_layers": [0]}),
                A.Variant("references-false", {"distill.references": False})]
    spec = A.AblationSpec(recipe=str(_base(tmp_path, source=str(tmp_path / "m"), draft_vocab_size=0)),
                          out=str(tmp_path / "out"), variants=variants, prompts=3, max_new_tokens=8,
                          per_category=1, temperatures=(0.0,))
    monkeypatch.setattr(A, "run_bench", lambda model, head, t, spec, json_path: {"tau": 1.0, "per_category": {}})
    got = A.run_ablation(spec, say=lambda s: None)
    out = tmp_path / "out"

    def inode(variant, name):
        return (out / variant / "distill" / name).stat().st_ino

    shard = "target/features/shard-00000.safetensors"
    assert inode("regress-none", "samples.jsonl") == inode("baseline", "samples.jsonl")
    assert inode("regress-none", shard) == inode("baseline", shard)
    assert got["regress-none"]["train"]["data_from"] == "baseline"
    assert inode("layers", "samples.jsonl") == inode("baseline", "samples.jsonl")
    assert inode("layers", shard) != inode("baseline", shard)  # 2 layers' features: its own shards
    assert got["layers"]["train"]["data_from"] == "baseline (answers)"
    assert inode("references-false", "samples.jsonl") != inode("baseline", "samples.jsonl")
    assert "data_from" not in got["references-false"]["train"]
    assert got["references-false"]["train"]["sequences"] < got["baseline"]["train"]["sequences"]
    assert "(data of baseline)" in (out / "ablation.md").read_text()
