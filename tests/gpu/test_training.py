"""Drafter training on one GPU: the tiny smoke run (tests.drafters.train_smoke) under Lightning's
`ddp` (NCCL) and `deepspeed_stage_2` strategies. Skipped without CUDA (the CPU ddp test is
tests/drafters/test_train.py)."""
import json
import subprocess
import sys

import pytest

from polybasic.models.eagle_head import load_head
from tests.devices import GPU
from tests.drafters.train_smoke import tiny_base

pytestmark = GPU


def smoke(out, strategy: str) -> dict:
    cmd = [sys.executable, "-m", "tests.drafters.train_smoke", str(out), "--strategy", strategy,
           "--devices", "1", "--epochs", "4", "--accelerator", "gpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2"])
def test_one_gpu_training(tmp_path, strategy):
    if strategy == "deepspeed_stage_2":
        pytest.importorskip("deepspeed", reason="pip install -e '.[gpu]' (make gpu-check does)")
    r = smoke(tmp_path, strategy)
    assert r["global_step"] == 16  # 8 samples, batch 2, 4 epochs, one rank
    losses = r["losses"]
    assert sum(losses[-4:]) < sum(losses[:4])  # it learns
    head = load_head(tmp_path / "head.safetensors", tiny_base())  # the exported head reloads on the CPU
    # the same weights the rank held: fp32 training, so the sums agree to fp64 rounding of fp32 values
    assert abs(float(sum(p.double().sum() for p in head.parameters())) - r["checksum"]) < 1e-6
