"""Peer methods run in their own process: a crash, an exit or a hang there ends that method only, reported
with its signal or exit code, the prompt it was on and its last stderr lines; every other method's figures
stand. The peer is a test engine (tests/bench/peer_stubs.py) behind the real worker and protocol."""
import json
from pathlib import Path

import pytest

from polybasic.bench.methods import METHODS, PeerRunner
from polybasic.bench.peers import MethodFailed, PeerProcess
from polybasic.cli import main
from tests.bench.peer_stubs import ENGINE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def stub_peers(monkeypatch):
    """Methods segv-peer, exit-peer and hang-peer: one good decode, then a SIGSEGV, exit code 3 or a hang."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the child imports tests.bench.peer_stubs
    for mode in ("segv", "exit", "hang"):
        monkeypatch.setitem(METHODS, f"{mode}-peer", lambda ctx, arg, mode=mode: PeerRunner(
            ctx, f"{mode}-peer", ENGINE, {"mode": mode, "ok": 1}))


def bench(model, questions, tmp_path, methods, *extra):
    out = tmp_path / "b.json"
    rc = main(["bench", "--model", str(model), "--questions", str(questions), "--per-category", "1",
               "--max-new-tokens", "6", "--methods", methods, "--warmup", "0", "--no-progress", "--json", str(out),
               "--report", str(tmp_path / "rep"), *extra])
    return rc, json.loads(out.read_text())


def test_a_crashed_or_exited_peer_is_reported_and_the_others_stand(stub_peers, tiny_model_dir, questions_file,
                                                                   tmp_path, capsys):
    rc, d = bench(tiny_model_dir, questions_file, tmp_path, "vanilla,pld,segv-peer,exit-peer")
    assert rc == 0
    segv, exited = d["failed"]["segv-peer"], d["failed"]["exit-peer"]
    # prompts: question 0 (writing), 2 (qa), 3 (math); each peer decoded the first and died on the second
    assert (segv["signal"], segv["exit_code"], segv["stage"], segv["question_id"], segv["category"]) == \
        ("SIGSEGV", None, "prompt", 2, "qa")
    assert (exited["signal"], exited["exit_code"], exited["question_id"]) == (None, 3, 2)
    assert "stub peer: giving up (segv)" in segv["stderr"][-1] and "stub peer: loaded" in segv["stderr"]
    assert list(d["methods"]) == ["vanilla", "pld"]  # the failed ones' figures would cover one prompt
    assert all(v["identical_to_vanilla"] == "3/3" and v["prompts"] == 3 for v in d["methods"].values())
    assert sum(r["method"] == "segv-peer" for r in d["records"]) == 1
    out = capsys.readouterr().out
    assert "segv-peer FAILED: killed by SIGSEGV on question 2 (qa)" in out
    assert "exit-peer FAILED: exited with code 3 on question 2 (qa)" in out
    row = next(line for line in out.splitlines() if line.startswith("segv-peer "))
    assert row.split()[1] == "FAILED"
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "## Failed methods" in report and "    stub peer: giving up (segv)" in report


def test_a_hung_peer_times_out(stub_peers, tiny_model_dir, questions_file, tmp_path, capsys):
    rc, d = bench(tiny_model_dir, questions_file, tmp_path, "vanilla,hang-peer", "--peer-timeout", "2")
    assert rc == 0
    hung = d["failed"]["hang-peer"]
    assert hung["reason"] == "no reply within 2 s (killed)" and (hung["question_id"], hung["category"]) == (2, "qa")
    assert d["methods"]["vanilla"]["prompts"] == 3
    assert "hang-peer FAILED: no reply within 2 s (killed) on question 2 (qa)" in capsys.readouterr().out


def test_a_peer_that_cannot_load_fails_at_load(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    with pytest.raises(MethodFailed) as e:
        PeerProcess("p", "tests.bench.peer_stubs:no_such_engine", {}, timeout=30)
    f = e.value.failure
    assert (f.stage, f.exit_code) == ("load", 1) and "no_such_engine" in f.stderr[-1]


def test_a_peer_decodes_with_the_requests_settings(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    peer = PeerProcess("p", ENGINE, {"mode": "exit", "ok": 5, "max_new_tokens": 2}, timeout=30)
    try:
        reply = peer.request({"prompt": [5, 6, 7], "seed": 0})
        assert reply["tokens"] == [5, 6] and reply["wall_s"] > 0
    finally:
        peer.close()
