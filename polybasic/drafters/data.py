"""Self-distillation data: the base model answers instruction prompts; the head learns from its
own outputs. Prompts come from a JSON list or JSONL file in Alpaca or ShareGPT format. Features and
base logits are NOT stored: the training step recomputes them from the lean model on the fly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from polybasic.errors import ConfigError
from polybasic.pipelines.records import read_records
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.sampling import SamplingConfig, make_generator
from polybasic.runtime.text import encode_prompt

DEFAULT_DATA = "../shared/data/alpaca_1000/alpaca_data_cleaned_1000.json"
SCHEMA = ('Alpaca: [{"instruction": str, "input": str (optional), "output": str}, ...] or '
          'ShareGPT: [{"conversations": [{"from": "human", "value": str}, {"from": "gpt", "value": str}, ...]}, ...]'
          ' (a JSON list, or one object per line in a .jsonl file)')


def _prompt(rec, i: int, path: Path) -> str:
    if isinstance(rec, dict) and isinstance(rec.get("instruction"), str):
        extra = rec.get("input") or ""
        return rec["instruction"] + (f"\n\n{extra}" if extra else "")
    if isinstance(rec, dict) and isinstance(rec.get("conversations"), list):
        for turn in rec["conversations"]:  # the first user turn; the base model writes the answer
            if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
                return turn["value"]
    raise ConfigError(f"data.path: record {i} of {path} is neither Alpaca nor ShareGPT "
                      f"(got {str(rec)[:80]!r}); expected {SCHEMA}")


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """User prompts from an Alpaca or ShareGPT JSON/JSONL file (first `limit` records)."""
    p = Path(path)
    recs = read_records(p, "data.path", f"{SCHEMA} (default {DEFAULT_DATA})")[:limit]
    prompts = [_prompt(r, i, p) for i, r in enumerate(recs)]
    prompts = [x for x in prompts if x.strip()]
    if not prompts:
        raise ConfigError(f"data.path: {p} holds no usable prompts; expected {SCHEMA}")
    return prompts


@dataclass
class Sample:
    tokens: list[int]  # prompt + the base model's answer
    n_prompt: int  # loss only on the answer


def self_distill(model, tokenizer, prompts: list[str], max_new_tokens: int = 128,
                 sampling: SamplingConfig = SamplingConfig(), seed: int = 0, max_prompt_tokens: int = 512,
                 eos: set[int] | None = None, progress: bool = False) -> list[Sample]:
    """Base-model answers (chat template), one prompt at a time (the lean decoder has no padding
    masks, so no batching yet). Prompts longer than max_prompt_tokens are left-truncated."""
    from tqdm import tqdm

    g = make_generator(seed)
    eos = eos if eos is not None else ({tokenizer.eos_token_id} - {None})
    out, n_new, t0 = [], 0, time.perf_counter()
    bar = tqdm(prompts, desc="self-distill", unit="prompt", disable=not progress)
    for text in bar:
        ids = encode_prompt(tokenizer, text)[-max_prompt_tokens:]
        ans = list(generate_tokens(model, ids, max_new_tokens, sampling, eos, g))
        out.append(Sample(ids + ans, len(ids)))
        n_new += len(ans)
        bar.set_postfix(tok_s=f"{n_new / (time.perf_counter() - t0):.1f}")
    return out


class DistillDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[Sample], max_len: int) -> None:
        if not samples:
            raise ConfigError("data: the self-distillation set is empty; pass a file with prompts")
        self.samples, self.max_len = samples, max_len

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


def collate(batch: list[Sample], max_len: int = 1 << 30) -> dict[str, Tensor]:
    """Right-padded tokens [B, T] and loss mask [B, T] (1 on answer tokens; padding is harmless
    under causal attention)."""
    t = min(max(len(s.tokens) for s in batch), max_len)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t)
    for i, s in enumerate(batch):
        n = min(len(s.tokens), t)
        tokens[i, :n] = torch.tensor(s.tokens[:n])
        mask[i, s.n_prompt:n] = 1.0
    return {"tokens": tokens, "mask": mask}


class EpochSampler(torch.utils.data.Sampler):
    """Seeded shuffle per epoch, sharded over ranks: the order depends only on (seed, epoch), so a
    run resumed at an epoch boundary sees the same batches as an uninterrupted one."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    @staticmethod
    def _ranks() -> tuple[int, int]:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        rank, world = self._ranks()
        per = self.n // world
        return iter(order[rank * per:(rank + 1) * per])

    def __len__(self) -> int:
        return self.n // self._ranks()[1]
