"""The command line, end to end on a tiny local model folder."""
import json

import pytest

from polybasic.cli import main
from tests.helpers import tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_folder(path, init_std=0.2)
    return str(path)


def test_generate_json(folder, capsys):
    assert main(["generate", "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", "12",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"text", "new_tokens", "tokens_per_s", "stats", "times_s"}
    assert 1 <= out["new_tokens"] <= 12 and out["tokens_per_s"] > 0
    assert set(out["times_s"]) == {"load", "first_token"} and min(out["times_s"].values()) > 0


def test_generate_compiled_chain_says_it_compiles(folder, capsys):
    """--compile with a chain compiles every model level before the first token, says so, and reports the
    time apart; the text equals the eager chain's (greedy, fp32)."""
    argv = ["generate", "--model", folder, "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "12",
            "--chain", "target+target@bfloat16+ngram", "--json"]
    assert main(argv) == 0
    eager = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(argv + ["--compile"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert "compiling every level's steps" in captured.err
    assert out["times_s"]["compile"] > 0 and out["text"] == eager["text"]


def test_generate_streams_text(folder, capsys):
    assert main(["generate", "--model", folder, "--prompt", "w1 w2", "--max-new-tokens", "8",
                 "--temperature", "0.8", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "tokens/s" in captured.err


def test_generate_with_a_chain(folder, capsys):
    args = ["generate", "--model", folder, "--prompt", "w1 w2 w1 w2", "--max-new-tokens", "16", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--chain", f"{folder}@bfloat16+ngram", "--k", "3"]) == 0
    chained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert chained["text"] == plain["text"]
    assert [lv["name"] for lv in chained["stats"]["levels"]] == ["target", f"{folder}@bfloat16", "ngram"]
    assert main(args + ["--chain", f"{folder}@bfloat16", "--k", "8", "--draft-confidence", "0.9"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"] == plain["text"]


@pytest.mark.parametrize("argv, match", [
    (["--model", "no-such-model"], "model: 'no-such-model' is not a known name"),
    (["--max-new-tokens", "0"], "max_new_tokens: must be a positive integer"),
    (["--top-p", "0"], "top_p: must be in (0, 1]"),
    (["--model", "/nonexistent/m.gguf"], "does not exist"),
    (["--chain", "ngram", "--k", "0"], "k: must be an integer >= 1"),
    (["--chain", "ngram", "--draft-confidence", "1"], "draft_confidence: must be in [0, 1)"),
])
def test_errors_are_clear(folder, capsys, argv, match):
    base = ["generate", "--model", folder, "--prompt", "w1"]
    assert main(base + argv) == 2
    assert match in capsys.readouterr().err


def test_prompt_longer_than_context(folder, capsys):
    assert main(["generate", "--model", folder, "--prompt", " ".join(["w5"] * 300), "--no-chat"]) == 2
    assert "prompt: 300 tokens do not fit the model's context window of 256" in capsys.readouterr().err
