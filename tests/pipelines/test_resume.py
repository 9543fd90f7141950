"""Killed jobs resume with nothing lost and the same result.

Each fault test runs a stage in a subprocess with POLYBASIC_KILL_AT set, checks that it died by
SIGKILL, runs it again (killed again at a later point, then to the end), and compares every
output with an uninterrupted run in another folder: torch.equal on every tensor, equal report
figures (timings aside), no temp file left. Both runs use one thread (conftest; OMP_NUM_THREADS=1
in the subprocesses) on the same machine, so bitwise equality is the contract.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from polybasic import artifacts
from polybasic.cli import main
from tests.helpers import tiny_hf_folder
from tests.pipelines.test_quantize import _recipe as quantize_recipe

TIMINGS = {"run_id", "calib_s", "wall_s", "latency_ms"}  # durations and run ids: the only values that may differ


def run_killed(argv: list[str], kill_at: str, tmp_path: Path) -> str:
    """`polybasic ARGV` in a subprocess that must die by SIGKILL at `kill_at`; returns its stdout."""
    env = {**os.environ, artifacts.KILL_ENV: kill_at, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    code = "import sys; from polybasic.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == -signal.SIGKILL, f"not killed at {kill_at}: rc {res.returncode}\n{res.stderr[-3000:]}"
    return res.stdout


def partials(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.name.endswith(artifacts.SUFFIX) or ".tmp" in p.name)


def _drop_timings(x):
    if isinstance(x, dict):
        return {k: _drop_timings(v) for k, v in x.items() if k not in TIMINGS}
    if isinstance(x, list):
        return [_drop_timings(v) for v in x]
    return x


def assert_equal_tree(a, b, where: str) -> None:
    """Nested dicts / lists of tensors and plain values: tensors torch.equal, the rest ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_equal_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_outputs(ref: Path, got: Path) -> None:
    """Every output of two runs of a stage is equal (tensors bitwise), timings aside."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    files = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
    for rel in files:
        a, b, where = ref / rel, got / rel, str(rel)
        if rel.suffix == ".safetensors":
            assert_equal_tree(load_file(a), load_file(b), where)
            with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
                assert fa.metadata() == fb.metadata(), where
        elif rel.suffix == ".pt":
            assert_equal_tree(torch.load(a), torch.load(b), where)
        elif rel.suffix == ".ckpt":
            ca, cb = (torch.load(p, weights_only=False) for p in (a, b))
            for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step", "epoch"):
                assert_equal_tree(ca[key], cb[key], f"{where}:{key}")
        elif rel.suffix == ".json" and not rel.name.startswith("latency-"):
            assert _drop_timings(json.loads(a.read_text())) == _drop_timings(json.loads(b.read_text())), where
        elif rel.suffix in (".jsonl", ".yaml"):
            assert a.read_text() == b.read_text(), where


# ---- the artifacts module -----------------------------------------------------------------------
def test_atomic_write_leaves_old_file_or_new_one(tmp_path):
    p = tmp_path / "a" / "x.json"
    artifacts.write_json(p, {"v": 1})
    with pytest.raises(RuntimeError):
        with artifacts.atomic_path(p) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert json.loads(p.read_text()) == {"v": 1} and os.listdir(p.parent) == ["x.json"]
    artifacts.save_safetensors(tmp_path / "t.safetensors", {"w": torch.arange(3)}, {"format": "f"})
    artifacts.torch_save(tmp_path / "o.pt", {"w": torch.ones(2)})
    assert torch.equal(torch.load(tmp_path / "o.pt")["w"], torch.ones(2)) and not partials(tmp_path)


def test_atomic_files_get_the_umask_mode(tmp_path):
    """Writers that create 0600 temp files (safetensors does) still leave a file others may read."""
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        artifacts.save_safetensors(tmp_path / "a.safetensors", {"x": torch.zeros(2)})
        with artifacts.atomic_path(tmp_path / "b.safetensors") as tmp:
            save_file({"x": torch.zeros(2)}, tmp)
            os.chmod(tmp, 0o600)
    finally:
        os.umask(old)
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in ("a.safetensors", "b.safetensors")] == [0o644, 0o644]


def test_clean_partials_removes_only_dead_writers(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / "sub" / f".model.safetensors.{dead}.partial"
    stale.parent.mkdir()
    stale.write_text("x")
    (tmp_path / f".dir.{dead}.partial").mkdir()
    live = tmp_path / f".x.json.{os.getpid()}.partial"
    live.write_text("being written")
    removed = artifacts.clean_partials(tmp_path)
    assert sorted(removed) == sorted([stale, tmp_path / f".dir.{dead}.partial"])
    assert live.exists() and not stale.exists()


def test_fault_point_spec_and_seeds(monkeypatch):
    for spec, want in (("write/model.safetensors", ("write/model.safetensors", 1)),
                       ("calibrate.block:3", ("calibrate.block", 3)), ("", None)):
        monkeypatch.setattr(artifacts, "_kill_at", False)
        monkeypatch.setenv(artifacts.KILL_ENV, spec)
        assert artifacts._target() == want
    monkeypatch.setattr(artifacts, "_kill_at", ("other", 1))
    artifacts.fault_point("write")  # not the named point: returns
    assert artifacts.seed_for(0, 1, 2) == artifacts.seed_for(0, 1, 2) != artifacts.seed_for(0, 2, 1)


def test_sampler_resumes_mid_epoch_with_the_next_batch():
    from polybasic.drafters.data import EpochSampler

    full = EpochSampler(12, seed=3, lengths=list(range(12)), batch_size=2)
    full.set_epoch(1)
    order = list(full)
    part = EpochSampler(12, seed=3, lengths=list(range(12)), batch_size=2)
    part.set_epoch(1)
    it = iter(part)
    head = [next(it) for _ in range(4)]  # two batches handed out
    state = part.state_dict()
    assert state == {"epoch": 1, "batches": 2} and head == order[:4]
    resumed = EpochSampler(12, seed=3, lengths=list(range(12)), batch_size=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == order[4:]
    resumed.set_epoch(2)  # the skip applies to its own epoch only
    assert len(list(resumed)) == 12


# ---- quantize -----------------------------------------------------------------------------------
def test_quantize_killed_mid_calibration_and_mid_write_resumes_identically(tmp_path, capsys):
    recipe = quantize_recipe(tmp_path)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    assert main(["quantize", str(recipe), "--out", str(ref)]) == 0
    argv = ["quantize", str(recipe), "--out", str(out)]
    run_killed(argv, "calibrate.block:1", tmp_path)  # the recipe's cell (w4a4 affinequant), block 0 saved
    assert not (out / "report.json").exists() and len(list(out.glob("work/*/block_*.pt"))) == 1
    # resumes block 1 of that cell, runs the w4a4/w4a16 rtn cells, dies in w4a16 affinequant
    text = run_killed(argv, "calibrate.block:6", tmp_path)
    assert "resumed: blocks 0 of 2 of cell w4a4-g32/affinequant" in text
    assert json.loads((out / "report.json").read_text())["done_cells"] == "3/4"
    text = run_killed(argv, "write/model.safetensors", tmp_path)  # temp file written, not yet renamed
    assert "resumed: blocks 0-1 of 2 of cell w4a4-g32/affinequant" in text
    assert [p.name.split(".")[1:3] for p in partials(out)] == [["model", "safetensors"]]
    assert main(["quantize", str(recipe), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "removed 1 temp file(s) of an interrupted run" in text
    assert "resumed: blocks 0-1 of 2 of cell w4a4-g32/affinequant" in text and "reused: latency table" in text
    assert "reused: cell w4a16-g32/rtn" in text and "resumed: blocks 0 of 2 of cell w4a16-g32/affinequant" in text
    assert not partials(out)
    assert_same_outputs(ref, out)


# ---- distill ------------------------------------------------------------------------------------
def test_checkpoint_every_n_steps_is_validated():
    from polybasic.config import section_from_dict
    from polybasic.errors import ConfigError

    with pytest.raises(ConfigError, match=r"distill\.train: .*checkpoint_every_n_steps: must be an int >= 0"):
        section_from_dict({"train": {"checkpoint_every_n_steps": -1}})
    assert section_from_dict({}).train.checkpoint_every_n_steps == 200


def _distill_recipe(tmp_path: Path) -> Path:
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}" + " w9" * (i % 3), "input": "",
                                 "output": f"w{i + 2} w3"} for i in range(6)]))
    recipe = {"name": "tiny", "out_dir": str(tmp_path / "run"), "model": {"source": str(tmp_path / "m")},
              "distill": {"data": str(data), "max_new_tokens": 6, "temperature": 0.8, "self_instruct": 2,
                          "gen_batch_size": 4, "gen_dtype": "float32", "feature_dtype": "float32",
                          "train": {"batch_size": 2, "max_epochs": 2, "lr": 1e-3, "noise_std": 0.2,
                                    "checkpoint_every_n_steps": 3}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_distill_killed_answering_more_data_resumes_identically(tmp_path):
    """kill -9 while the target answers a `more_data` set: the rerun keeps data's shards and the set's finished one,
    and ends with the outputs of an uninterrupted run."""
    recipe = _distill_recipe(tmp_path)
    more = tmp_path / "more.json"
    more.write_text(json.dumps([{"instruction": f"w{i} w{i + 2} w7", "input": "", "output": ""} for i in range(5)]))
    tree = yaml.safe_load(recipe.read_text())
    tree["distill"].update(more_data=[str(more)], self_instruct=0, train={"batch_size": 2, "max_epochs": 1,
                                                                            "lr": 1e-3})
    recipe.write_text(yaml.safe_dump(tree))
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert main(["distill", str(recipe), "--out", str(ref)]) == 0
    argv = ["distill", str(recipe), "--out", str(run)]
    run_killed(argv, "distill.samples_shard:3", tmp_path)  # data's two answer shards, then the set's first
    assert [p.name for p in sorted((run / "distill" / "samples" / "more-0").glob("*.jsonl"))] == ["answers-00000.jsonl"]
    assert main(argv) == 0
    assert_same_outputs(ref, run)


def test_distill_killed_mid_generation_training_and_write_resumes_identically(tmp_path, capsys):
    recipe = _distill_recipe(tmp_path)
    ref, run = tmp_path / "ref", tmp_path / "killed"
    assert main(["distill", str(recipe), "--out", str(ref)]) == 0
    out, argv = run / "distill", ["distill", str(recipe), "--out", str(run)]
    n_samples = len((ref / "distill" / "samples.jsonl").read_text().splitlines())
    steps = n_samples // 2  # per epoch: batches of 2
    assert steps > 3  # so that the step-3 checkpoint falls inside the first epoch

    run_killed(argv, "distill.samples_shard:2", tmp_path)  # two generation batches saved
    shards = sorted(p.name for p in (out / "samples").glob("*.jsonl"))
    assert shards in (["answers-00000.jsonl", "prompts-00000.jsonl"], ["prompts-00000.jsonl", "prompts-00001.jsonl"])
    assert not (out / "samples.jsonl").exists()
    text = run_killed(argv, "train.checkpoint:1", tmp_path)  # step 3, mid-epoch
    assert "resumed: 2 finished generation shard(s)" in text
    ckpt = torch.load(out / "target" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3 and ckpt["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"] == 0
    # resumed at step 3; killed at the epoch's end (after the step-6 checkpoint if that is inside the epoch)
    text = run_killed(argv, f"train.checkpoint:{2 if steps > 6 else 1}", tmp_path)
    assert "(0 epoch(s) finished, step 3)" in text and "reused: 1 feature shard(s)" in text
    assert torch.load(out / "target" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == steps
    text = run_killed(argv, "write/head.safetensors:2", tmp_path)  # the head's write at the last checkpoint
    assert f"(1 epoch(s) finished, step {steps})" in text
    assert [p.name.split(".")[1:3] for p in partials(out)] == [["head", "safetensors"]]
    assert main(argv) == 0
    assert "removed 1 temp file(s)" in capsys.readouterr().out
    assert not partials(run)
    assert_same_outputs(ref, run)
