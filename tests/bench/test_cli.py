"""`polybasic bench` end to end on a tiny random model folder, and its input errors."""
import json

import pytest

from polybasic.bench.methods import BenchContext, make_runner, parse_methods
from polybasic.cli import main
from tests.helpers import lean_from_hf, tiny_hf_llama


@pytest.mark.parametrize("argv, words", [
    (["--bundle", "b"], "the bundle names its target; drop --model"),
    (["--methods", "vanilla,chain"], "pass --bundle"),
    (["--methods", "vanilla,nope"], "methods: unknown nope"),
    (["--methods", "hf,hf"], "names a method twice"),
    (["--methods", "vanilla:x"], "takes no ':' argument"),
    (["--max-new-tokens", "0"], "max_new_tokens: must be >= 1"),
    (["--temperature", "-1"], "temperature"),
    (["--per-category", "0"], "per_category"),
    (["--categories", "nope"], "categories: unknown nope"),
    (["--methods", "vanilla-compiled", "--warmup", "0"], "warmup: vanilla-compiled compiles on its first"),
])
def test_bad_input_fails_before_loading(questions_file, capsys, argv, words):
    rc = main(["bench", "--model", "/nonexistent", "--questions", str(questions_file), *argv])
    assert rc == 2 and words in capsys.readouterr().err


def test_missing_questions_names_schema(tmp_path, capsys):
    assert main(["bench", "--questions", str(tmp_path / "no.jsonl")]) == 2
    assert '{"question_id", "category", "turns": [...]}' in capsys.readouterr().err


def test_parse_methods_puts_vanilla_first():
    assert parse_methods("pld,hf") == ["vanilla", "pld", "hf"]
    assert parse_methods("hf, vanilla") == ["vanilla", "hf"]


def test_runners_agree_with_vanilla_at_greedy():
    hf = tiny_hf_llama(seed=0)
    ctx = BenchContext(lean_from_hf(hf), None, {1}, 12, hf_loader=lambda: hf, draft_tokens=4,
                       max_prompt_tokens=8)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ref = make_runner("vanilla", ctx)(prompt, 0)
    assert 0 < len(ref.tokens) <= 12 and ref.wall_s > 0 and ref.tau is None
    for name in ("hf", "hf-pld", "pld", "vanilla-compiled"):
        out = make_runner(name, ctx)(prompt, 0)
        assert out.tokens == ref.tokens, name
    assert make_runner("pld", ctx)(prompt, 0).tau >= 1.0


def test_end_to_end_on_tiny_model(tiny_model_dir, questions_file, tmp_path, capsys):
    out, rep = tmp_path / "b.json", tmp_path / "rep"
    rc = main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file),
               "--per-category", "1", "--categories", "writing,qa", "--max-new-tokens", "8",
               "--methods", "vanilla,hf,hf-pld,pld,chain:target+target@bfloat16+ngram", "--json", str(out),
               "--report", str(rep), "--no-progress", "--warmup", "1"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert list(d["methods"]) == ["vanilla", "hf", "hf-pld", "pld", "chain:target+target@bfloat16+ngram"]
    assert d["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)
    assert d["methods"]["pld"]["tau"] >= 1.0 and d["methods"]["hf"]["tau"] is None
    for v in d["methods"].values():
        assert v["identical_to_vanilla"] == "2/2"
        assert set(v["per_category"]) == {"writing", "qa"}
    assert len(d["records"]) == 10 and all(r["new_tokens"] > 0 for r in d["records"])
    assert d["machine"]["command"].startswith("polybasic bench") and d["config"]["prompts"] == 2
    assert "vanilla" in capsys.readouterr().out
    assert "--max-new-tokens 8" in (rep / "report.md").read_text()


def test_sampling_run_reports_no_identity(tiny_model_dir, questions_file, tmp_path):
    out = tmp_path / "b.json"
    rc = main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file),
               "--per-category", "1", "--max-new-tokens", "6", "--methods", "hf,hf-pld,pld",
               "--temperature", "0.8", "--top-p", "0.9", "--json", str(out), "--no-progress",
               "--warmup", "0"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert all(v["identical_to_vanilla"] is None for v in d["methods"].values())
    assert len(d["records"]) == 12


def test_questions_without_categories_report_one_category(tiny_model_dir, tmp_path):
    from tests.bench.conftest import write_questions

    q = write_questions(tmp_path / "flat.jsonl", [{"question_id": i, "turns": [f"w{i} w{i + 1} w{i}"]}
                                                  for i in range(3)])
    out, rep = tmp_path / "b.json", tmp_path / "rep"
    assert main(["bench", "--model", str(tiny_model_dir), "--questions", str(q), "--per-category", "2",
                 "--max-new-tokens", "4", "--methods", "pld", "--json", str(out), "--report", str(rep),
                 "--no-progress", "--warmup", "0"]) == 0
    d = json.loads(out.read_text())
    assert d["config"]["categories"] == ["uncategorized"] and d["config"]["prompts"] == 2
    assert all(list(v["per_category"]) == ["uncategorized"] for v in d["methods"].values())
    assert "uncategorized" in (rep / "report.md").read_text()


def test_help_lists_every_method():
    from polybasic.bench.cli import METHOD_NAMES
    from polybasic.bench.methods import METHODS, TAKES_ARG

    # 'chain' alone runs a --bundle's chain
    assert set(METHOD_NAMES) == {m + ":SPEC" if m in TAKES_ARG else m for m in METHODS} | {"chain"}
