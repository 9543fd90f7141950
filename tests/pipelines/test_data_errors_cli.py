"""Bad data through the real CLI: exit code 2, the file and field named, no traceback, nothing written.

The recipes name a real (tiny) model folder, so a data error that came after the model load would
still reach the data; every case asserts the out_dir was never created.
"""
import json
import subprocess
import sys

import pytest
import yaml

from tests.helpers import tiny_hf_folder

BAD = {
    "foo.jsonl": ("\n".join(json.dumps({"foo": i}) for i in range(8)) + "\n",
                  r"line 1 of {path} fits no record schema"),
    "broken.jsonl": ("\n".join([json.dumps({"instruction": f"w{i}", "output": "w1"}) for i in range(5)]
                               + ['{"instruction": "w1", "output": ', json.dumps({"instruction": "w2"})]) + "\n",
                     r"line 6 of {path} is not valid JSON"),
    "missing.json": (None, r"{path} does not exist; fix {field}\.path"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_hf_folder(path, vocab=64, init_std=0.2)
    return path


def _run_bad_case(stage, bad, model, tmp_path, run):
    """Write a recipe whose `<stage>.data` is the bad file, run the command from another folder."""
    import re

    text, expected = BAD[bad]
    (tmp_path / "recipe").mkdir()
    if text is not None:
        (tmp_path / "recipe" / bad).write_text(text)
    recipe = {"name": "bad", "out_dir": "run", "model": {"source": str(model)}, stage: {"data": bad}}
    (tmp_path / "recipe" / "r.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "cwd").mkdir()
    code, stderr = run([stage, str(tmp_path / "recipe" / "r.yaml")], tmp_path / "cwd")
    assert code == 2, stderr
    assert "Traceback" not in stderr
    path = re.escape(str(tmp_path / "recipe" / bad))  # resolved against the recipe's folder, not the cwd
    assert re.search(rf"^error: {stage}\.data: " + expected.format(path=path, field=f"{stage}\\.data"),
                     stderr, re.M), stderr
    assert list((tmp_path / "cwd").iterdir()) == []  # out_dir (cwd/run) never created


# the real command in a subprocess (the user's experience); it starts in several seconds (torch,
# Lightning), so one case per bad input here and the full stage x input grid in process below
@pytest.mark.parametrize("stage,bad", [("quantize", "foo.jsonl"), ("distill", "broken.jsonl"),
                                       ("quantize", "missing.json")])
def test_bad_data_through_the_command(stage, bad, model, tmp_path):
    def run(argv, cwd):
        out = subprocess.run([sys.executable, "-m", "polybasic.cli", *argv], cwd=cwd, capture_output=True,
                             text=True, timeout=120)
        return out.returncode, out.stderr

    _run_bad_case(stage, bad, model, tmp_path, run)


@pytest.mark.parametrize("stage", ["quantize", "distill"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_data_fails_before_the_model_loads(stage, bad, model, tmp_path, monkeypatch, capsys):
    from polybasic.cli import main

    def run(argv, cwd):
        monkeypatch.chdir(cwd)
        code = main(argv)
        return code, capsys.readouterr().err

    _run_bad_case(stage, bad, model, tmp_path, run)
