"""`polybasic bench` end to end on a tiny random model folder, and its input errors."""
import json

import pytest

from polybasic.bench.methods import BenchContext, make_runner, parse_methods, split_source_dtype
from polybasic.cli import main
from polybasic.errors import ConfigError
from tests.helpers import lean_from_hf, tiny_hf_llama


@pytest.mark.parametrize("argv, words", [
    (["--bundle", "b"], "the bundle names its target; drop --model"),
    (["--methods", "vanilla,chain"], "pass --bundle"),
    (["--methods", "vanilla,nope"], "methods: unknown nope"),
    (["--methods", "hf,hf"], "names a method twice"),
    (["--methods", "hf:x"], "takes no ':' argument"),
    (["--methods", "vanilla:float13"], "methods: 'vanilla:float13': unknown dtype 'float13'; use one of float32"),
    (["--methods", "vanilla:"], "empty argument after 'vanilla:'"),
    (["--methods", "hf-assisted"], "'hf-assisted' needs an argument; spell it hf-assisted:SOURCE[@DTYPE]"),
    (["--methods", "hf-assisted:smollm2-135m@fp13"], "methods: 'hf-assisted:smollm2-135m@fp13': unknown dtype"),
    (["--methods", "hf-assisted:/nonexistent/x"], "methods: 'hf-assisted:/nonexistent/x': "),
    (["--max-new-tokens", "0"], "max_new_tokens: must be >= 1"),
    (["--temperature", "-1"], "temperature"),
    (["--per-category", "0"], "per_category"),
    (["--categories", "nope"], "categories: unknown nope"),
])
def test_bad_input_fails_before_loading(questions_file, capsys, argv, words):
    rc = main(["bench", "--model", "/nonexistent", "--questions", str(questions_file), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err


@pytest.fixture
def quantized_file(tmp_path, tiny_model_dir):
    """A file that passes the header checks of a quantized copy (no loadable weights)."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "q.safetensors"
    save_file({"x": torch.zeros(1)}, path, metadata={"format": "polybasic.quant", "source": str(tiny_model_dir)})
    return path


@pytest.mark.parametrize("method, words", [
    ("vanilla:bf16", "a quantized copy runs in the dtype and kernels it was saved with"),
    ("vanilla-dense", "loads the target again in another dtype or without its kernel"),
    ("hf-assisted:{q}", "a quantized copy has no transformers model"),
])
def test_quantized_sources_fail_before_loading(questions_file, quantized_file, capsys, method, words):
    rc = main(["bench", "--model", str(quantized_file), "--questions", str(questions_file),
               "--methods", method.format(q=quantized_file)])
    assert rc == 2 and words in capsys.readouterr().err


def test_missing_questions_names_schema(tmp_path, capsys):
    assert main(["bench", "--questions", str(tmp_path / "no.jsonl")]) == 2
    assert '{"question_id", "category", "turns": [...]}' in capsys.readouterr().err


def test_parse_methods_puts_vanilla_first():
    assert parse_methods("pld,hf") == ["vanilla", "pld", "hf"]
    assert parse_methods("hf, vanilla") == ["vanilla", "hf"]


def test_parse_methods_checks_arguments(tiny_model_dir):
    assistant = f"hf-assisted:{tiny_model_dir}"
    assert parse_methods(f"vanilla:bfloat16,{assistant}") == ["vanilla", "vanilla:bfloat16", assistant]
    assert parse_methods("hf-assisted:owner/name@bf16,vanilla:fp32")[1:] == ["hf-assisted:owner/name@bf16",
                                                                           "vanilla:fp32"]  # a Hub id
    assert split_source_dtype("a/b@bf16") == ("a/b", "bf16") and split_source_dtype("x@y/z") == ("x@y/z", None)
    with pytest.raises(ConfigError, match=r"methods: 'vanilla:float13': unknown dtype 'float13'; use one of"):
        parse_methods("vanilla:float13")
    with pytest.raises(ConfigError, match=r"methods: 'hf-assisted:.*@float13': unknown dtype"):
        parse_methods(f"{assistant}@float13")


def test_runners_agree_with_vanilla_at_greedy():
    hf = tiny_hf_llama(seed=0)
    ctx = BenchContext(lean_from_hf(hf), None, {1}, 12, hf_loader=lambda: hf, draft_tokens=4,
                       prompt_tokens=(8,))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ref = make_runner("vanilla", ctx)(prompt, 0)
    assert 0 < len(ref.tokens) <= 12 and ref.wall_s > 0 and ref.tau is None
    for name in ("hf", "hf-pld", "pld", "vanilla-compiled", "pld-compiled", "chain-compiled:target+ngram"):
        out = make_runner(name, ctx)(prompt, 0)
        assert out.tokens == ref.tokens, name
    assert make_runner("pld", ctx)(prompt, 0).tau >= 1.0


def test_compiled_runners_warm_every_prompts_cache_size():
    """Prompts of two cache size classes in one run: vanilla-compiled compiles both before the first timed
    prompt (BenchContext.prompt_tokens), so neither prompt compiles, and both decode as vanilla does."""
    from torch._dynamo.utils import counters

    hf = tiny_hf_llama(seed=0, max_pos=1024)
    prompts = [[5, 6, 7] * 3, [2 + i % 90 for i in range(300)]]  # caches of 256 and 512 rows
    ctx = BenchContext(lean_from_hf(hf), None, {1}, 12, prompt_tokens=tuple(map(len, prompts)))
    vanilla, compiled = make_runner("vanilla", ctx), make_runner("vanilla-compiled", ctx)
    before = counters["frames"]["ok"]
    for prompt in prompts:
        assert compiled(prompt, 0).tokens == vanilla(prompt, 0).tokens
    assert counters["frames"]["ok"] == before, "a timed prompt compiled a step"


def test_vanilla_dtype_and_hf_assisted_agree_with_vanilla(tiny_model_dir):
    """vanilla:float32 reloads the float32 target; greedy assisted generation (the tiny model assisting
    itself) is lossless."""
    from polybasic.models import load_hf_model, load_model

    lm = load_model(str(tiny_model_dir), "float32")
    ctx = BenchContext(lm.model, lm.tokenizer, {1}, 12, source=str(tiny_model_dir), dtype="float32",
                       hf_loader=lambda: load_hf_model(str(tiny_model_dir)))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ref = make_runner("vanilla", ctx)(prompt, 0)
    again = make_runner("vanilla:float32", ctx)
    assert again(prompt, 0).tokens == ref.tokens
    assisted = make_runner(f"hf-assisted:{tiny_model_dir}", ctx)(prompt, 0)
    assert assisted.tokens == ref.tokens and assisted.wall_s > 0
    assert make_runner("vanilla:bf16", ctx)(prompt, 0).tokens  # runs in bfloat16
    compiled = make_runner("vanilla-compiled:float32", ctx)  # a reloaded copy, its step compiled
    assert compiled(prompt, 0).tokens == ref.tokens


def test_chain_reports_every_link(tiny_model_dir):
    from polybasic.models import load_model

    lm = load_model(str(tiny_model_dir), "float32")
    ctx = BenchContext(lm.model, lm.tokenizer, {1}, 12, draft_tokens=4, source=str(tiny_model_dir))
    out = make_runner("chain:target+target@bfloat16+ngram", ctx)([5, 6, 7, 5, 6, 7, 5, 6], 0)
    assert list(out.links) == ["target<-target@bfloat16", "target@bfloat16<-ngram"]
    assert out.accepted == out.links["target@bfloat16<-ngram"] and out.links["target<-target@bfloat16"]


def test_chain_drafts_compiled_keeps_the_eager_target(tiny_model_dir):
    """chain-drafts-compiled compiles the levels below the target (its own copies) and leaves the target
    eager, so its tokens are eager vanilla's; with draft_confidence its drafts may end early."""
    from polybasic.models import load_model

    lm = load_model(str(tiny_model_dir), "float32")
    ctx = BenchContext(lm.model, lm.tokenizer, {1}, 12, draft_tokens=6, source=str(tiny_model_dir),
                       prompt_tokens=(8,), draft_confidence=0.5)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    ref = make_runner("vanilla", ctx)(prompt, 0)
    method = f"chain-drafts-compiled:{tiny_model_dir}@bfloat16"
    out = make_runner(method, ctx)(prompt, 0)
    assert out.tokens == ref.tokens and out.tau >= 1.0
    assert ctx.compile_s[method] > 0 and lm.model._static is None  # drafts compiled, the target not
    draft = ctx.drafts_compiled_levels[f"{tiny_model_dir}@bfloat16"]
    assert draft.model._static is not None and draft.model is not ctx.levels.get(f"{tiny_model_dir}@bfloat16")


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


def test_end_to_end_reports_links_and_fastest_vanilla(tiny_model_dir, questions_file, tmp_path, capsys):
    out, rep = tmp_path / "b.json", tmp_path / "rep"
    methods = ["vanilla", "vanilla:bfloat16", "chain:target@bfloat16+ngram"]
    rc = main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file),
               "--per-category", "1", "--categories", "qa", "--max-new-tokens", "8",
               "--methods", ",".join(methods), "--json", str(out), "--report", str(rep), "--no-progress", "--warmup", "0"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert list(d["methods"]) == methods and d["fastest_vanilla"] in methods[:2]
    s = d["methods"]
    assert s[d["fastest_vanilla"]]["speedup_vs_fastest_vanilla"] == pytest.approx(1.0)
    assert all(s[m]["speedup_vs_fastest_vanilla"] <= 1.0 + 1e-9 for m in methods[:2])
    links = s[methods[2]]["links"]
    assert list(links) == ["target<-target@bfloat16", "target@bfloat16<-ngram"]
    assert all(v >= 1 for v in links.values())
    assert s[methods[2]]["accept_len"] == pytest.approx(links["target@bfloat16<-ngram"])
    assert s["vanilla"]["links"] is None and s[methods[2]]["identical_to_vanilla"] == "1/1"
    assert d["machine"]["peak_rss_mib"] > 0
    assert all((r["links"] is not None) == (r["method"] == methods[2]) for r in d["records"])
    report = (rep / "report.md").read_text()
    for words in ("| vs fastest |", "| links |", "target<-target@bfloat16 ", "Fastest vanilla decoder of this "
                  f"run: {d['fastest_vanilla']}", "Peak RSS", "not expected to be identical"):
        assert words in report, words
    assert "vs fastest" in capsys.readouterr().out


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
    from polybasic.bench import METHOD_NAMES
    from polybasic.bench.methods import ARGS, METHODS

    # a method whose argument is optional is listed with and without it
    assert set(METHOD_NAMES) == ({f"{m}:{a.form}" for m, a in ARGS.items()}
                                 | {m for m in METHODS if m not in ARGS or not ARGS[m].required})


def test_per_draft_acceptance_leaves_out_empty_drafts(tiny_model_dir, monkeypatch):
    """A chain whose target verifies an empty draft (the budget's last token) still counts that target
    forward in tau, but the drafter's accepted lengths cover only the drafts it made."""
    from polybasic.models import load_model
    from polybasic.runtime import chain as chain_mod

    seen = {}
    real = chain_mod.Chain.generate

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        seen["stats"] = out[1]
        return out

    monkeypatch.setattr(chain_mod.Chain, "generate", spy)
    lm = load_model(str(tiny_model_dir), "float32")
    ctx = BenchContext(lm.model, lm.tokenizer, set(), 11, draft_tokens=4, source=str(tiny_model_dir))
    out = make_runner("chain:target+target@bfloat16", ctx)([5, 6, 7, 5, 6, 7, 5, 6], 0)
    link = seen["stats"].links[0]
    assert 0 in link.drafted  # the run did verify an empty draft
    assert out.accepted == [a for a, d in zip(link.accepted, link.drafted) if d]
    assert out.tau == len(out.tokens) / seen["stats"].target_forwards


def test_predict_prices_every_chain_method(tiny_model_dir, questions_file, tmp_path, capsys):
    """--predict N profiles each chain method's levels on N held-out (Alpaca) prompts and fills its predicted
    speedup; plain decoding has none; --predict must not be negative."""
    out = tmp_path / "b.json"
    methods = ["vanilla", "pld", "chain:target@bfloat16+ngram/2"]
    rc = main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file), "--per-category", "1",
               "--categories", "qa", "--max-new-tokens", "8", "--draft-tokens", "3", "--methods", ",".join(methods),
               "--json", str(out), "--no-progress", "--warmup", "0", "--predict", "2"])
    assert rc == 0
    d = json.loads(out.read_text())["methods"]
    assert d["vanilla"]["predicted_speedup"] is None
    assert all(d[m]["predicted_speedup"] > 0 for m in methods[1:])
    assert "profiling its levels" in capsys.readouterr().err
    assert main(["bench", "--model", "/nonexistent", "--questions", str(questions_file), "--predict", "-1"]) == 2
    assert "predict: must be >= 0" in capsys.readouterr().err


def test_predict_measures_a_chain_s_drafts_cut_as_it_runs_them(tiny_model_dir, questions_file, tmp_path, monkeypatch):
    """With --draft-confidence, --predict measures the bottom pair's drafts with that cut (their measured lengths
    priced), and an n-gram bottom, which cannot tell a confidence, without."""
    import polybasic.bench.predict as bp

    seen = []
    measure = bp.pair_acceptance

    def spy(v, d, *a, draft_confidence=0.0, **kw):
        seen.append((d.name, draft_confidence))
        return measure(v, d, *a, draft_confidence=draft_confidence, **kw)

    monkeypatch.setattr(bp, "pair_acceptance", spy)
    out = tmp_path / "b.json"
    methods = ["vanilla", "chain:target@bfloat16", "pld"]
    assert main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file), "--per-category", "1",
                 "--categories", "qa", "--max-new-tokens", "8", "--draft-tokens", "3", "--draft-confidence", "0.5",
                 "--methods", ",".join(methods), "--json", str(out), "--no-progress", "--warmup", "0",
                 "--predict", "2"]) == 0
    d = json.loads(out.read_text())["methods"]
    assert d["chain:target@bfloat16"]["predicted_speedup"] > 0 and d["pld"]["predicted_speedup"] > 0
    assert sorted(seen) == [("ngram", 0.0), ("target@bfloat16", 0.5)]
