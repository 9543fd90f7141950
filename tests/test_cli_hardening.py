"""Bad input through the real command line (a subprocess): exit code 2, the file or flag and item
named, no traceback, nothing written. Also: start-up imports, --version, help texts, long prompts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polybasic.cli import main
from tests.bench.conftest import write_questions
from tests.damaged import damage, write_weight_files

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "lightning", "pytorch_lightning", "datasets")


def run_cli(*args: str, cache: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "POLYBASIC_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "polybasic.cli", *args], capture_output=True, text=True,
                          input=stdin, env=env, cwd=REPO, timeout=300)


def assert_clean_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") or r.stderr.startswith("usage: "), r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """Good and damaged inputs: model folders, quantized copies, heads, GGUF files, questions."""
    import numpy as np
    from gguf import GGUFWriter

    d = write_weight_files(tmp_path_factory.mktemp("cli_inputs"), init_std=0.2)
    g = GGUFWriter(str(d / "g.gguf"), "llama")  # a tiny GGUF whose tensor data is then cut off
    g.add_block_count(1)
    g.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    damage(d / "g.gguf", d / "g_trunc.gguf", "trunc")
    damage(d / "g.gguf", d / "g_rand.gguf", "rand")
    write_questions(d / "q.jsonl", [{"question_id": i, "category": "c", "turns": ["w1 w2 w3"]} for i in range(2)])
    return d


@pytest.mark.parametrize("argv, words", [
    (["--model", "{d}/m_rand"], ["--model", "{d}/m_rand/model.safetensors", "not a safetensors file",
                                 "download or save the model folder again"]),
    (["--model", "{d}/m_trunc"], ["--model", "{d}/m_trunc/model.safetensors", "truncated"]),
    (["--model", "{d}/q_rand.safetensors"], ["--model", "{d}/q_rand.safetensors", "not a safetensors file",
                                             "polybasic quantize"]),
    (["--model", "{d}/q_trunc.safetensors"], ["{d}/q_trunc.safetensors", "truncated", "polybasic quantize"]),
    (["--chain", "{d}/q_rand.safetensors"], ["--chain: level '{d}/q_rand.safetensors'", "not a safetensors file"]),
    (["--chain", "{d}/q_trunc.safetensors"], ["--chain: level '{d}/q_trunc.safetensors'", "truncated"]),
    (["--chain", "eagle:{d}/h_rand.safetensors"], ["--chain: level 'eagle:{d}/h_rand.safetensors'",
                                                   "not a safetensors file", "polybasic distill"]),
    (["--chain", "eagle:{d}/h_trunc.safetensors"], ["--chain: level 'eagle:{d}/h_trunc.safetensors'", "truncated"]),
    (["--model", "{d}/g_rand.gguf"], ["--model", "{d}/g_rand.gguf", "not a GGUF file", "download g_rand.gguf"]),
    (["--chain", "foo+bar"], ["--chain: level 'foo'", "'foo' is not a known name"]),
    (["--chain", "ngram:x"], ["--chain: level 'ngram:x'", "integer n-gram size"]),
    (["--chain", "eagle:missing.safetensors"], ["--chain: level 'eagle:missing.safetensors'", "does not exist"]),
    (["--prompt-file", "{d}/missing.txt"], ["--prompt-file", "{d}/missing.txt", "does not exist"]),
    (["--prompt", "x", "--prompt-file", "{d}/q.jsonl"], ["not allowed with argument"]),
    (["x", "--prompt-file", "{d}/q.jsonl"], ["not allowed with argument"]),
])
def test_generate_bad_input(w, tmp_path, argv, words):
    argv = [a.format(d=w) for a in argv]
    if "--prompt-file" not in argv:
        argv += ["--prompt", "w1 w2"]
    if "--model" not in argv:
        argv += ["--model", str(w / "m")]
    r = run_cli("generate", *argv, "--max-new-tokens", "4", "--json", cache=tmp_path / "cache")
    assert_clean_error(r, *(x.format(d=w) for x in words))
    assert r.stdout == ""  # no JSON: nothing was generated
    assert not any((tmp_path / "cache" / "models").glob("*"))  # no (half-)converted model left


@pytest.mark.parametrize("method, words", [
    ("chain:foo", ["--methods chain:foo: level 'foo'", "is not a known name"]),
    ("chain:ngram:x", ["--methods chain:ngram:x: level 'ngram:x'", "integer n-gram size"]),
    ("chain:{d}/q_trunc.safetensors", ["level '{d}/q_trunc.safetensors'", "truncated"]),
    ("chain:eagle:{d}/h_rand.safetensors", ["level 'eagle:{d}/h_rand.safetensors'", "not a safetensors file"]),
    ("chain:eagle:missing.safetensors", ["level 'eagle:missing.safetensors'", "does not exist"]),
])
def test_bench_bad_chain_writes_nothing(w, tmp_path, method, words):
    out, rep = tmp_path / "out.json", tmp_path / "rep"
    r = run_cli("bench", "--model", str(w / "m"), "--questions", str(w / "q.jsonl"), "--methods",
                method.format(d=w), "--json", str(out), "--report", str(rep), cache=tmp_path / "cache")
    assert_clean_error(r, *(x.format(d=w) for x in words))
    assert not out.exists() and not rep.exists()


def test_truncated_gguf_leaves_no_converted_folder(w, tmp_path, monkeypatch, capsys):
    """Past the magic check, transformers' GGUF reader fails deep inside: a clean error, and the
    cache holds no half-converted folder. (In-process: the subprocess cases above cover tracebacks.)"""
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    assert main(["generate", "--model", str(w / "g_trunc.gguf"), "--prompt", "x", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and f"{w / 'g_trunc.gguf'}: cannot be read as a GGUF model" in out.err
    assert "download g_trunc.gguf again" in out.err
    assert not any((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.parametrize("model, words", [("{d}/m_trunc", ["--model", "truncated"]),
                                          ("nope", ["--model: 'nope' is not a known name"])])
def test_bench_bad_model_writes_nothing(w, tmp_path, capsys, model, words):
    out = tmp_path / "out.json"
    assert main(["bench", "--model", model.format(d=w), "--questions", str(w / "q.jsonl"), "--methods", "pld",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert all(x in err for x in words) and not out.exists(), err


def test_chain_errors_come_before_the_target_loads(w, monkeypatch, capsys):
    import polybasic.models

    def boom(*a, **k):
        raise AssertionError("the target loaded before --chain was checked")

    monkeypatch.setattr(polybasic.models, "load_model", boom)
    assert main(["generate", "--model", str(w / "m"), "--prompt", "x", "--chain", "foo+bar"]) == 2
    assert "--chain: level 'foo'" in capsys.readouterr().err


def test_parser_and_argument_errors_import_nothing_heavy():
    code = ("import sys, polybasic.cli as c\n"
            "p = c.build_parser()\n"
            "p.parse_args(['generate', '--prompt', 'x', '--chain', 'ngram'])\n"
            "try:\n    p.parse_args(['generate', '--k', 'x'])\nexcept SystemExit:\n    pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def test_version_and_help(tmp_path):
    from polybasic import __version__

    r = run_cli("--version", cache=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"polybasic {__version__}"
    gen = run_cli("generate", "--help", cache=tmp_path).stdout
    for form in ("eagle:PATH", "PATH.safetensors", "SOURCE[@DTYPE]", "ngram[:N]", "target@DTYPE",
                 "(default: smollm2-135m)", "(default: 128)", "--prompt-file"):
        assert form in gen, form
    bench = run_cli("bench", "--help", cache=tmp_path).stdout
    assert "eagle:PATH" in bench and "chain:SPEC" in bench and "(default: vanilla,hf,hf-pld,pld;" in bench
    assert "(default: the recipe's out_dir)" in run_cli("quantize", "--help", cache=tmp_path).stdout


def test_long_prompt_from_stdin_and_file(w, tmp_path, capsys):
    """50,000 words (more than one argument may hold) arrive whole: the tiny model's 256-token
    context then rejects them with a clear error."""
    words = " ".join(["w5"] * 50_000)
    too_long = "prompt: 50000 tokens do not fit the model's context window of 256"
    base = ["generate", "--model", str(w / "m"), "--no-chat", "--max-new-tokens", "2", "--json"]
    r = run_cli(*base, "--prompt", "-", cache=tmp_path / "cache", stdin=words)
    assert_clean_error(r, too_long)
    assert r.stdout == ""
    (tmp_path / "p.txt").write_text(words)
    assert main(base + ["--prompt-file", str(tmp_path / "p.txt")]) == 2
    out = capsys.readouterr()
    assert too_long in out.err and out.out == ""


def test_prompt_from_stdin_and_file_generate(w, tmp_path, monkeypatch, capsys):
    import io

    base = ["generate", "--model", str(w / "m"), "--no-chat", "--max-new-tokens", "6", "--json"]
    assert main(base + ["--prompt", "w1 w2 w3 w1 w2"]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert main(base + ["w1 w2 w3 w1 w2"]) == 0  # the prompt as the positional argument
    assert json.loads(capsys.readouterr().out)["text"] == ref["text"]
    (tmp_path / "p.txt").write_text("w1 w2 w3 w1 w2")
    assert main(base + ["--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == ref["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("w1 w2 w3 w1 w2"))
    assert main(base + ["--prompt", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == ref["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    assert main(base + ["--prompt", "-"]) == 2
    assert "--prompt -: stdin is empty" in capsys.readouterr().err


def test_good_files_pass_the_checks(w, capsys):
    """The same kinds of files, undamaged, go through: a quantized copy as the target, a model
    folder and a head in the chain."""
    assert main(["generate", "--model", str(w / "q.safetensors"), "--chain",
                 f"{w / 'm'}@bf16+eagle:{w / 'h.safetensors'}", "--prompt", "w1 w2 w3", "--max-new-tokens", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [lv["name"] for lv in out["stats"]["levels"]] == ["target", f"{w / 'm'}@bf16", f"eagle:{w / 'h.safetensors'}"]
