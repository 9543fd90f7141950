"""Training: loss goes down, safetensors checkpoint reloads, seeded resume, DDP on CPU, DeepSpeed config."""
import json
import subprocess
import sys

import pytest
import torch

from polybasic.config import TrainConfig
from polybasic.drafters.data import DistillDataset
from polybasic.drafters.module import deepspeed_config, fit, strategy_for
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, load_head
from tests.drafters.train_smoke import tiny_base, tiny_samples


@pytest.fixture(scope="module")
def world():
    base = tiny_base()
    return base, DistillDataset(tiny_samples(base), 64)


def run(world, out, epochs, stop_after=None, **kw):
    """Train for `epochs`; stop_after=N interrupts the same run after N epochs."""
    base, ds = world
    cfg = TrainConfig(lr=3e-3, batch_size=2, max_epochs=epochs, **kw)
    return fit(base, ds, DrafterConfig.for_base(base.args), cfg, out, accelerator="cpu",
               max_epochs=stop_after or epochs)


def test_loss_goes_down_and_checkpoint_reloads(world, tmp_path):
    m = run(world, tmp_path, 4)
    assert len(m.losses) == 16
    assert sum(m.losses[-4:]) < sum(m.losses[:4])
    head = load_head(tmp_path / "head.safetensors", world[0])
    for k, v in m.head.state_dict().items():
        assert torch.equal(head.state_dict()[k], v)
    assert "tok_embeddings.weight" not in head.state_dict()  # base weights are shared, not saved


def test_resume_continues_exactly(world, tmp_path):
    full = run(world, tmp_path / "full", 4).losses
    part = run(world, tmp_path / "part", 4, stop_after=2).losses  # interrupted at the end of epoch 2
    rest = run(world, tmp_path / "part", 4).losses  # resumes from last.ckpt (end of epoch 2)
    assert part == full[:8]
    assert rest == full[8:]  # bitwise: the resumed run continues exactly


def test_checkpoint_refused_on_other_hidden_size(world, tmp_path):
    run(world, tmp_path, 1)
    other = tiny_base(dim=48)
    with pytest.raises(ConfigError, match="32.*48"):
        load_head(tmp_path / "head.safetensors", other)


def test_ddp_two_cpu_processes(tmp_path):
    cmd = [sys.executable, "-m", "tests.drafters.train_smoke", str(tmp_path), "--strategy", "ddp",
           "--devices", "2", "--epochs", "4"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["checksum"] == r1["checksum"]  # both ranks hold the same weights
    assert r0["global_step"] == r1["global_step"] == 8
    both = [a + b for a, b in zip(r0["losses"], r1["losses"])]
    assert sum(both[-2:]) < sum(both[:2])
    head = load_head(tmp_path / "head.safetensors", tiny_base())
    assert abs(float(sum(p.double().sum() for p in head.parameters())) - r0["checksum"]) < 1e-6


def test_deepspeed_needs_gpu_and_config_is_valid():
    cfg = TrainConfig(strategy="deepspeed_stage_2", batch_size=3, precision="bf16-mixed")
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["bf16"]["enabled"]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="deepspeed_stage_2 needs CUDA"):
            strategy_for(cfg)
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(ds, world_size=1)


def test_config_validation():
    with pytest.raises(ConfigError, match="strategy"):
        TrainConfig(strategy="fsdp")
    with pytest.raises(ConfigError, match="ttt_steps"):
        TrainConfig(ttt_steps=0)
    with pytest.raises(ConfigError, match="ttt_decay"):
        TrainConfig(ttt_decay=0.0)
    with pytest.raises(ConfigError, match="DrafterConfig.version"):
        DrafterConfig(dim=8, vocab_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=8, version=9)
    with pytest.raises(ConfigError, match="DrafterConfig.n_kv_heads"):
        DrafterConfig(dim=8, vocab_size=8, n_heads=2, n_kv_heads=3, head_dim=4, intermediate_size=8)
