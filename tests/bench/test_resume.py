"""Results written as they come: a bench killed with SIGKILL half-way and run again with --resume gives the
table of an uninterrupted run; a changed command is refused before any model loads."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polybasic.bench import suite
from polybasic.cli import main

ROOT = Path(__file__).resolve().parents[2]
METHODS = "vanilla,pld,chain:target+target@bfloat16+ngram"
# the CLI in a child process whose every record is followed by a pause, so that the test can kill it half-way
SLOW_CLI = """import sys, time
from polybasic.bench.records import RunLog
from polybasic.cli import main
real = RunLog.record
RunLog.record = lambda self, r: (real(self, r), time.sleep(0.3))
sys.exit(main(sys.argv[1:]))
"""


def argv(model, questions, rep, *extra):
    return ["bench", "--model", str(model), "--questions", str(questions), "--max-new-tokens", "6",
            "--methods", METHODS, "--warmup", "1", "--no-progress", "--report", str(rep), *extra]


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def kill_half_way(args: list[str], records: Path, after: int) -> None:
    """Run the CLI in a child process and SIGKILL it once `records` holds `after` records."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while sum(e["kind"] == "record" for e in lines(records)) < after:
            assert proc.poll() is None and time.monotonic() < deadline, "the bench ended before it was killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def table(doc: dict) -> dict:
    """What must not depend on the kill: token counts, identity, tau and acceptance, per method and category."""
    keys = ("new_tokens", "prompts", "identical_to_vanilla", "tau", "accept_len", "links", "mismatches")
    return {m: ({k: v.get(k) for k in keys}, {c: g["new_tokens"] for c, g in v["per_category"].items()})
            for m, v in doc["methods"].items()}


def test_a_killed_bench_resumes_to_the_uninterrupted_table(tiny_model_dir, questions_file, tmp_path, capsys):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(argv(tiny_model_dir, questions_file, whole)) == 0
    full = json.loads((whole / "bench.json").read_text())
    kill_half_way(argv(tiny_model_dir, questions_file, cut), cut / "records.jsonl", after=7)
    assert not (cut / "bench.json").exists() and 7 <= len(lines(cut / "records.jsonl")) - 1 < 18

    assert main(argv(tiny_model_dir, questions_file, cut, "--resume")) == 0
    resumed = json.loads((cut / "bench.json").read_text())
    assert table(resumed) == table(full)
    assert [(r["method"], r["question_id"]) for r in resumed["records"]] == \
        [(r["method"], r["question_id"]) for r in full["records"]]  # the same interleaved, rotated order
    entries = lines(cut / "records.jsonl")
    assert entries[0]["kind"] == "header" and sum(e["kind"] == "record" for e in entries) == 18  # none twice
    assert all(len(e["tokens"]) == e["new_tokens"] for e in entries if e["kind"] == "record")


@pytest.mark.parametrize("extra, words", [
    (["--seed", "1"], "--resume: seed changed: the records in {p} were measured with seed = 0, this command has 1"),
    (["--max-new-tokens", "5"], "--resume: max_new_tokens changed"),
    (["--methods", "vanilla,pld"], "--resume: methods changed"),
])
def test_a_changed_command_is_refused_before_loading(tiny_model_dir, questions_file, tmp_path, capsys, monkeypatch,
                                                     extra, words):
    rep = tmp_path / "rep"
    assert main(argv(tiny_model_dir, questions_file, rep, "--per-category", "1")) == 0
    before = (rep / "records.jsonl").read_bytes()
    monkeypatch.setattr(suite, "load_any_model", lambda *a: pytest.fail("the target loaded"))
    capsys.readouterr()
    assert main(argv(tiny_model_dir, questions_file, rep, "--per-category", "1", "--resume", *extra)) == 2
    err = capsys.readouterr().err
    assert words.format(p=rep / "records.jsonl") in err and "drop --resume" in err and "another --report" in err
    assert (rep / "records.jsonl").read_bytes() == before


def test_resume_needs_a_records_file(tiny_model_dir, questions_file, capsys):
    assert main(["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file), "--resume"]) == 2
    assert "--resume: continues the records of a --report folder or --json file" in capsys.readouterr().err


def test_a_run_without_resume_moves_the_earlier_records_aside(tiny_model_dir, questions_file, tmp_path):
    out = tmp_path / "b.json"  # --json alone: the records beside it
    args = ["bench", "--model", str(tiny_model_dir), "--questions", str(questions_file), "--per-category", "1",
            "--max-new-tokens", "4", "--methods", "vanilla", "--warmup", "0", "--no-progress", "--json", str(out)]
    assert main(args) == 0 and main(args) == 0
    kept = sorted(p.name for p in tmp_path.glob("b.records*.jsonl"))
    assert len(kept) == 2 and "b.records.jsonl" in kept
    assert all(len(lines(tmp_path / k)) == 4 for k in kept)  # header and 3 records each


def test_the_recipe_bench_stage_continues_or_starts_over(tmp_path, questions_file):
    """The recipes' bench stage (`polybasic run`) continues a killed run's records and starts over, the old
    ones moved aside, when its recipe or bundle changed."""
    from types import SimpleNamespace as NS

    from polybasic.bench.questions import load_questions, select
    from polybasic.bench.runner import Record
    from polybasic.pipelines.bench import _args

    recipe = NS(bench=NS(questions=str(questions_file), per_category=1, categories=[], max_new_tokens=4,
                         methods=None, warmup=0, repeat=1), profile=NS(temperature=0.0, top_p=1.0, k=3),
                model=NS(dtype="float32", device="cpu"), export=NS(folder="bundle"))
    manifest = tmp_path / "bundle" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text("{}")
    a = _args(recipe, tmp_path)
    questions = select(load_questions(a.questions), a.per_category)
    log = suite.open_run_log(a, ["vanilla", "chain"], questions, restart_changed=True)
    log.record(Record("vanilla", 0, "writing", 3, 1, 0.1, None, [4]))
    log.close()
    assert len(suite.open_run_log(a, ["vanilla", "chain"], questions, restart_changed=True).records) == 1
    manifest.write_text('{"exported": "again"}')
    assert suite.open_run_log(a, ["vanilla", "chain"], questions, restart_changed=True).records == []
