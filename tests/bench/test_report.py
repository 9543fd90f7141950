"""Outputs: atomic writes, JSON document schema, markdown and stdout tables."""
import json
import os

from polybasic.artifacts import write_text
from polybasic.bench.report import machine_info, markdown, text_table, write_outputs
from polybasic.bench.runner import Record
from polybasic.bench.suite import build_document


def doc():
    records = [Record("vanilla", 1, "qa", 5, 4, 1.0, None, [1, 2, 3, 4]),
               Record("pld", 1, "qa", 5, 4, 0.5, 2.0, [1, 2, 3, 4])]
    return build_document(records, True, machine_info("float32", "polybasic bench --x 1"), {}, {"model": "m"})


def chain_doc():
    records = [Record("vanilla", 1, "qa", 5, 4, 1.0, None, [1, 2, 3, 4]),
               Record("vanilla:bfloat16", 1, "qa", 5, 4, 0.8, None, [1, 2, 3, 9]),
               Record("chain:a+ngram", 1, "qa", 5, 4, 0.4, 2.0, [1, 2, 3, 4], [1, 0],
                      {"target<-a": [3, 1], "a<-ngram": [1, 0]})]
    machine = {**machine_info("float32", "polybasic bench"), "peak_rss_mib": 1234.4}
    return build_document(records, True, machine, {}, {"model": "m"})


def test_document_schema():
    d = doc()
    assert set(d["machine"]) >= {"cpu", "cores", "torch", "threads", "dtype", "command"}
    for m in ("vanilla", "pld"):
        v = d["methods"][m]
        assert set(v) >= {"tokens_per_s", "speedup", "tau", "identical_to_vanilla", "predicted_speedup",
                          "per_category"}
        assert isinstance(v["tokens_per_s"], float) and isinstance(v["speedup"], float)
        assert set(v["per_category"]) == {"qa"}
    assert d["methods"]["pld"]["speedup"] == 2.0 and d["methods"]["pld"]["tau"] == 2.0
    assert "tokens" not in d["records"][0]
    json.dumps(d)


def test_tables_show_methods_and_command():
    d = doc()
    for text in (text_table(d), markdown(d)):
        assert "vanilla" in text and "pld" in text and "2.00x" in text and "qa" in text
    assert "`polybasic bench --x 1`" in markdown(d)


def test_tables_show_links_fastest_vanilla_and_memory():
    d = chain_doc()
    assert d["fastest_vanilla"] == "vanilla:bfloat16"
    assert d["methods"]["chain:a+ngram"]["speedup_vs_fastest_vanilla"] == 2.0
    for text in (text_table(d), markdown(d)):
        assert "vs fastest" in text and "target<-a 3.00, a<-ngram 1.50" in text and "2.00x" in text
    md = markdown(d)
    assert "Fastest vanilla decoder of this run: vanilla:bfloat16 (5.00 tokens/s)" in md
    assert "Peak RSS: 1234 MiB, of the whole process" in md and "not expected to be identical" in md
    assert "| vanilla:bfloat16 | 5.00 | 1.25x | 1.00x | 1.25x | - | - | - | 0/1 | - |" in md
    assert "Peak RSS" not in markdown(doc()) and "Fastest vanilla decoder of this run: vanilla " in markdown(doc())


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "out.json"
    write_text(p, "one")
    write_text(p, "two")
    assert p.read_text() == "two" and os.listdir(p.parent) == ["out.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert p.stat().st_mode & 0o777 == 0o666 & ~umask  # like any file the user creates


def test_write_outputs(tmp_path):
    write_outputs(doc(), tmp_path / "b.json", tmp_path / "rep")
    assert json.loads((tmp_path / "b.json").read_text())["methods"]["pld"]["identical_to_vanilla"] == "1/1"
    assert sorted(os.listdir(tmp_path / "rep")) == ["bench.json", "report.md", "speedup.png"]


def test_compiled_chains_are_also_compared_with_compiled_vanilla():
    """With vanilla-compiled in the run, every method also counts the prompts equal to its tokens (a compiled
    chain's own reference); without it, the column is absent."""
    records = [Record("vanilla", 1, "qa", 5, 4, 1.0, None, [1, 2, 3, 4]),
               Record("vanilla-compiled", 1, "qa", 5, 4, 0.8, None, [1, 2, 3, 9]),
               Record("chain-compiled:a", 1, "qa", 5, 4, 0.4, 2.0, [1, 2, 3, 9])]
    d = build_document(records, True, machine_info("float32", "polybasic bench"), {}, {"model": "m"})
    chain = d["methods"]["chain-compiled:a"]
    assert (chain["identical_to_vanilla"], chain["identical_to_vanilla_compiled"]) == ("0/1", "1/1")
    assert d["methods"]["vanilla"]["identical_to_vanilla_compiled"] == "0/1"
    assert "= compiled" in text_table(d) and "= compiled" in markdown(d)
    assert "identical_to_vanilla_compiled" not in chain_doc()["methods"]["chain:a+ngram"]
    assert "= compiled" not in text_table(chain_doc())
