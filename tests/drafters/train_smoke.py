"""Tiny end-to-end training run (used by the tests, e.g. DDP on CPU with 2 processes).

python -m tests.drafters.train_smoke OUT_DIR [--strategy ddp --devices 2] [--epochs N] [--accelerator gpu]
Writes OUT_DIR/rank{R}.json: {"losses": [...], "checksum": float, "global_step": int}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from polybasic.config import TrainConfig
from polybasic.drafters.data import DistillDataset, Sample
from polybasic.drafters.module import fit
from polybasic.models.args import ModelArgs
from polybasic.models.decoder import Transformer
from polybasic.models.eagle_head import DrafterConfig
from polybasic.runtime.context import ExecutionContext
from polybasic.runtime.generate import generate_tokens


def tiny_base(seed: int = 0, dim: int = 32, vocab: int = 64) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(vocab_size=vocab, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=dim // 4,
                     intermediate_size=2 * dim, max_seq_len=128, tie_embeddings=True)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    return model.eval().requires_grad_(False)


def tiny_samples(model: Transformer, n: int = 8, seed: int = 0) -> list[Sample]:
    """Self-distillation without a tokenizer: random prompts, the base model's greedy answers."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(2, model.args.vocab_size, (6,), generator=g).tolist()
        out.append(Sample(prompt + list(generate_tokens(model, prompt, 24)), len(prompt)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--accelerator", default="cpu", help="cpu, or gpu (the gpu tests: ddp / deepspeed_stage_2)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = tiny_base()
    cfg = TrainConfig(lr=3e-3, batch_size=2, max_epochs=a.epochs, strategy=a.strategy, devices=a.devices)
    # the execution context decides the strategy's backend (nccl / gloo) and the accelerator, as in a recipe
    ctx = ExecutionContext("cuda" if a.accelerator == "gpu" else "cpu", flag="--accelerator")
    module = fit(base, DistillDataset(tiny_samples(base), 64), DrafterConfig.for_base(base.args), cfg, a.out,
                 ctx=ctx)
    rank = module.global_rank
    checksum = float(sum(p.detach().double().sum() for p in module.head.parameters()))
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(
        {"losses": module.losses, "checksum": checksum, "global_step": module.global_step}))


if __name__ == "__main__":
    main()
