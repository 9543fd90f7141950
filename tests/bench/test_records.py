"""The records file: whole lines appended as they come, a partial last line ignored and cut on resume, a
changed config refused (or started over where asked), an earlier run's records moved aside."""
import json

import pytest

from polybasic.bench.peers import Failure
from polybasic.bench.records import open_log, read_entries, records_path
from polybasic.bench.runner import Record
from polybasic.errors import ConfigError, CorruptFileError

CONFIG = {"model": "m", "seed": 0, "methods": ["vanilla", "pld"]}
PROMPTS = [(1, "qa", [5, 6]), (2, "math", [7])]


def filled(path):
    """A records file with one record, one failure and one compile time."""
    log = open_log(path, CONFIG, resume=False)
    log.compiled("pld", 1.5)
    log.record(Record("vanilla", 1, "qa", 2, 3, 0.5, None, [1, 2, 3]))
    log.failure(Failure("pld", "killed by SIGSEGV", "SIGSEGV", None, "prompt", 1, "qa", ["boom"]))
    log.close()
    return path


def test_records_path():
    assert str(records_path("rep", "b.json")) == "rep/records.jsonl"
    assert str(records_path(None, "out/b.json")) == "out/b.records.jsonl" and records_path(None, None) is None


def test_resume_reads_every_kind_and_ignores_a_partial_last_line(tmp_path):
    path = filled(tmp_path / "records.jsonl")
    with path.open("ab") as f:
        f.write(b'{"kind": "record", "method": "vani')  # a kill in the middle of a write
    log = open_log(path, CONFIG, resume=True)
    assert [(r.method, r.tokens) for r in log.records] == [("vanilla", [1, 2, 3])]
    assert log.failures["pld"].signal == "SIGSEGV" and log.compile_s == {"pld": 1.5}
    assert log.done() == {("vanilla", 1, "qa")} and log.pending(CONFIG["methods"], PROMPTS) == ["vanilla"]
    log.record(Record("vanilla", 2, "math", 1, 1, 0.1, None, [4]))
    log.close()
    entries, end = read_entries(path)
    assert end == path.stat().st_size and [e["kind"] for e in entries] == ["header", "compile", "record", "failure",
                                                                           "record"]


def test_a_damaged_whole_line_is_named(tmp_path):
    path = filled(tmp_path / "records.jsonl")
    path.write_bytes(path.read_bytes().replace(b'"kind": "record"', b'"kind": record'))
    with pytest.raises(CorruptFileError, match=r"records\.jsonl line 3 is not JSON"):
        open_log(path, CONFIG, resume=True)


def test_changed_config_is_refused_or_started_over(tmp_path):
    path = filled(tmp_path / "records.jsonl")
    with pytest.raises(ConfigError, match=r"--resume: seed changed: .* seed = 0, this command has 1; "):
        open_log(path, {**CONFIG, "seed": 1}, resume=True)
    log = open_log(path, {**CONFIG, "seed": 1}, resume=True, restart_changed=True)
    assert log.records == [] and len(read_entries(path)[0]) == 4  # untouched until the first entry
    log.record(Record("vanilla", 1, "qa", 2, 1, 0.5, None, [9]))
    log.close()
    assert [e["kind"] for e in read_entries(path)[0]] == ["header", "record"]
    assert read_entries(path)[0][0]["config"]["seed"] == 1
    assert len(list(tmp_path.glob("records.*.jsonl"))) == 1  # the earlier run's, moved aside


def test_a_foreign_file_is_not_resumed(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"something": "else"}) + "\n")
    with pytest.raises(ConfigError, match="is not a records file of this bench"):
        open_log(path, CONFIG, resume=True)


def test_a_header_from_before_a_field_was_added_resumes_with_its_old_value(tmp_path):
    path = filled(tmp_path / "records.jsonl")  # CONFIG has no "repeat": measured once a prompt
    assert open_log(path, {**CONFIG, "repeat": 1}, resume=True).done() == {("vanilla", 1, "qa")}
    with pytest.raises(ConfigError, match=r"--resume: repeat changed: .* repeat = 1, this command has 3"):
        open_log(path, {**CONFIG, "repeat": 3}, resume=True)
