"""The benchmark stays out of training by content: any record holding a Spec-Bench question's text is
refused, whatever the file is called; the shipped data sets resolve by short name from any folder."""
import json

import pytest

from polybasic.config import DistillSection, ProfileSection, QuantizeSection, from_dict
from polybasic.data import DataSource, read_examples
from polybasic.data.catalog import SHIPPED, SPEC_BENCH, shipped_path
from polybasic.data.guard import benchmark_hashes, refuse_benchmark, text_hash
from polybasic.errors import ConfigError


def spec_bench_turns() -> list[str]:
    lines = shipped_path(SPEC_BENCH).read_text().splitlines()
    return [t for line in lines if line.strip() for t in json.loads(line)["turns"]]


def test_shipped_data_sets_are_package_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in SHIPPED:
        assert shipped_path(name).is_file() and DataSource(name).local_path() == shipped_path(name)
    assert (shipped_path(SPEC_BENCH).parent / "LICENSE").is_file()
    assert "CC BY-NC 4.0" in (shipped_path("alpaca-1000").parent / "NOTICE.md").read_text()
    assert len(read_examples(DataSource("alpaca-1000"), "distill.data")) == 1000  # and it passes the guard


def test_hashes_ignore_whitespace_but_not_words():
    assert text_hash("  What is  2+2?\n") == text_hash("What is 2+2?") != text_hash("What is 2+3?")
    assert len(benchmark_hashes()) == len(set(map(text_hash, spec_bench_turns()))) > 480


@pytest.mark.parametrize("shape", ["alpaca", "alpaca-input", "sharegpt", "text"])
def test_a_benchmark_question_under_any_name_and_schema_is_refused(tmp_path, shape):
    question = spec_bench_turns()[123]
    head, _, tail = question.partition(" ")
    rec = {"alpaca": {"instruction": " " + question + "\n", "output": "x"},
           "alpaca-input": {"instruction": head, "input": tail, "output": "x"},
           "sharegpt": {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "x"}]},
           "text": {"text": question}}[shape]
    rows = [{"instruction": "Name a river.", "output": "Rhine"}, rec]
    path = tmp_path / "innocent_prompts.json"
    path.write_text(json.dumps(rows))
    if shape == "alpaca-input" and head + "\n\n" + tail != question:
        # the guard hashes instruction + input as the stages join them; whitespace is normalised
        assert text_hash(head + "\n\n" + tail) == text_hash(question)
    with pytest.raises(ConfigError, match=r"distill\.data: .*innocent_prompts\.json holds 1 Spec-Bench question.*"
                                          r"record 2.*alpaca-1000"):
        read_examples(DataSource(str(path)), "distill.data")
    rows.pop()
    path.write_text(json.dumps(rows))
    assert len(read_examples(DataSource(str(path)), "distill.data")) == 1


def test_the_benchmark_file_copied_elsewhere_is_refused(tmp_path):
    copy = tmp_path / "my_questions.jsonl"
    copy.write_text(shipped_path(SPEC_BENCH).read_text())
    with pytest.raises(ConfigError, match=r"quantize\.data: .*holds 480 Spec-Bench question"):
        read_examples(DataSource(str(copy)), "quantize.data")
    with pytest.raises(ConfigError, match="profile.data: points at the Spec-Bench questions"):
        read_examples(DataSource(SPEC_BENCH), "profile.data")


@pytest.mark.parametrize("section, field", [(QuantizeSection, "quantize"), (DistillSection, "distill"),
                                            (ProfileSection, "profile")])
def test_sections_refuse_the_benchmark_by_name_before_reading(section, field):
    with pytest.raises(ConfigError, match=f"{field}.data: points at the Spec-Bench questions"):
        from_dict(section, {"data": SPEC_BENCH}, field)


def test_refuse_benchmark_counts_every_hit():
    turns = spec_bench_turns()
    with pytest.raises(ConfigError, match=r"f: src holds 2 Spec-Bench question\(s\) \(first: record 1\)"):
        refuse_benchmark([{"text": turns[0]}, {"x": 1}, {"conversations": [{"role": "user", "content": turns[5]}]}],
                         "src", "f")
