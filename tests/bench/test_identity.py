"""Lossless methods against their own reference: a warning naming the prompts and first differing positions,
the same in the JSON, and --strict's exit code."""
import json

import pytest

from polybasic.bench.identity import first_difference, identity_lines, not_identical
from polybasic.bench.methods import METHODS, Output
from polybasic.bench.report import machine_info
from polybasic.bench.runner import Record
from polybasic.bench.suite import build_document
from polybasic.cli import main


def rec(method, qid, tokens, cat="qa"):
    return Record(method, qid, cat, 5, len(tokens), 1.0, None, tokens)


def document(records, greedy=True):
    return build_document(records, greedy, machine_info("float32", "polybasic bench"), {}, {"model": "m"})


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a shorter output differs where it ends


def test_every_lossless_method_against_its_own_reference():
    ref, comp = [1, 2, 3, 4], [1, 2, 3, 9]
    records = [rec("vanilla", 1, ref), rec("vanilla", 2, ref, "math"), rec("vanilla-compiled", 1, comp),
               rec("vanilla-compiled", 2, comp, "math"),
               rec("pld", 1, ref), rec("pld", 2, [1, 7, 3, 4], "math"),  # differs at position 1 on question 2
               rec("chain-compiled:a", 1, comp), rec("chain-compiled:a", 2, comp, "math"),  # = vanilla-compiled
               rec("chain-drafts-compiled:a", 1, ref), rec("chain-drafts-compiled:a", 2, ref, "math"),  # eager target
               *(rec(m, q, [5], c) for m in ("hf", "llamacpp", "vanilla:bfloat16", "vanilla-dense")
                 for q, c in ((1, "qa"), (2, "math")))]
    d = document(records)
    m = d["methods"]
    assert m["pld"]["mismatches"] == [{"question_id": 2, "category": "math", "position": 1}]
    assert (m["chain-compiled:a"]["identity_reference"], m["chain-compiled:a"]["mismatches"]) == ("vanilla-compiled", [])
    assert (m["chain-drafts-compiled:a"]["identity_reference"], m["chain-drafts-compiled:a"]["mismatches"]) == \
        ("vanilla", [])
    assert all("mismatches" not in m[x] for x in ("hf", "llamacpp", "vanilla:bfloat16", "vanilla-dense", "vanilla"))
    assert not_identical(d) == ["pld"]
    assert identity_lines(d) == ["WARNING: pld is lossless but its tokens differ from vanilla's on 1/2 prompts, "
                                 "first at: question 2 (math) at token 1"]
    json.dumps(d)


def test_unchecked_without_its_reference_and_never_when_sampling():
    d = document([rec("vanilla", 1, [1, 2]), rec("pld-compiled", 1, [1, 3])])
    assert d["methods"]["pld-compiled"]["mismatches"] is None and not_identical(d) == []
    assert identity_lines(d) == ["note: pld-compiled: identity not checked, its reference vanilla-compiled is not in "
                                 "the run (add it to --methods)"]
    sampled = document([rec("vanilla", 1, [1, 2]), rec("pld", 1, [1, 3])], greedy=False)
    assert "mismatches" not in sampled["methods"]["pld"] and identity_lines(sampled) == []


@pytest.fixture
def broken_pld(monkeypatch):
    """pld-broken: our pld, with its 2nd timed prompt's token 3 changed (a lossless method gone wrong)."""
    def factory(ctx, arg):
        pld, calls = METHODS["pld"](ctx, None), []

        def run(ids, seed):
            out = pld(ids, seed)
            calls.append(1)
            if len(calls) == 2:
                out = Output(out.tokens[:3] + [out.tokens[3] + 1] + out.tokens[4:], out.wall_s, out.tau)
            return out
        return run
    monkeypatch.setitem(METHODS, "pld-broken", factory)


@pytest.mark.parametrize("method, rc", [("pld-broken", 1), ("pld", 0)])
def test_strict_exits_non_zero_when_a_lossless_method_differs(broken_pld, tiny_model_dir, questions_file, tmp_path,
                                                             capsys, method, rc):
    out = tmp_path / "b.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file), "--per-category", "1",
                 "--max-new-tokens", "6", "--methods", f"vanilla,{method}", "--warmup", "0", "--no-progress",
                 "--json", str(out), "--strict"]) == rc
    std = capsys.readouterr()
    d = json.loads(out.read_text())  # written before the exit code
    if rc:
        assert d["methods"][method]["mismatches"] == [{"question_id": 2, "category": "qa", "position": 3}]
        assert std.out.rstrip().endswith("WARNING: pld-broken is lossless but its tokens differ from vanilla's on "
                                         "1/3 prompts, first at: question 2 (qa) at token 3")
        assert "--strict: pld-broken not identical" in std.err
    else:
        assert d["methods"][method]["mismatches"] == [] and "WARNING" not in std.out
