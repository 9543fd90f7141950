"""Batched generation with left padding: many prompts answered in one decode loop.

Used where throughput matters more than latency (self-distillation data for drafters). Every row
gets the same number of cache slots; row b's prompt is right-aligned and the slots before it are
masked out, so (RoPE being relative) each row computes what it would alone, up to float rounding.
Rows that finished (EOS) leave the batch once a quarter of the rows still running have finished:
the KV caches shrink to the others, so short answers stop costing decode steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from polybasic.config import SamplingConfig
from polybasic.models.decoder import Transformer
from polybasic.runtime.generate import check_request, pick_token

COMPACT_SHARE = 0.25  # drop finished rows once they are this share of the rows still in the batch


@dataclass
class BatchAnswer:
    tokens: list[int]  # prompt + answer (EOS included when it was generated)
    n_prompt: int


@torch.inference_mode()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                   sampling: SamplingConfig = SamplingConfig(), eos: set[int] = frozenset(),
                   generator: torch.Generator | None = None) -> list[BatchAnswer]:
    """Answer every prompt (one batch; sort prompts by length first to waste less padding).

    A row stops at EOS or after max_new_tokens; the loop ends when every row has stopped.
    """
    budget = min(check_request(p, max_new_tokens, model.args.max_seq_len) for p in prompts)
    lens = torch.tensor([len(p) for p in prompts])  # [B]
    bsz, width = len(prompts), int(lens.max())
    total = width + budget + 1
    dev = model.device
    model.setup_caches(total, bsz)
    pad = width - lens  # [B] left padding per row
    tokens = torch.zeros(bsz, total, dtype=torch.long)  # [B, S] right-aligned prompts, then answers
    for b, p in enumerate(prompts):
        tokens[b, int(pad[b]):width] = torch.tensor(p)
    tokens = tokens.to(dev)
    key_mask = (torch.arange(total)[None] >= pad[:, None]).to(dev)  # [B, S]
    # last_only: the LM head runs on the newest row alone (every row's logits would be [B, W, V])
    logits = model(tokens[:, :width], 0, last_only=True, key_mask=key_mask)[0]  # [B, 1, V]
    logits = logits[:, -1]  # [B', V]: B' rows still in the batch
    out_tokens = tokens.clone()  # [B, S] every row's tokens, also after it left the batch
    rows = torch.arange(bsz, device=dev)  # [B'] the original index of each row in the batch
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)  # [B']
    n_new = torch.zeros(bsz, dtype=torch.long, device=dev)  # [B] answer length per original row
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=dev)
    pos = width
    for step in range(budget):
        nxt = pick_token(logits, sampling, generator)  # [B']
        tokens[:, pos] = torch.where(done, tokens[:, pos], nxt)  # [B']
        out_tokens[rows, pos] = tokens[:, pos]
        n_new[rows] += (~done).long()
        done |= torch.isin(nxt, eos_t)
        pos += 1
        if bool(done.all()) or step == budget - 1:
            break
        if int(done.sum()) >= max(1, COMPACT_SHARE * len(rows)):  # finished rows leave the batch
            live = (~done).nonzero().squeeze(1)  # [B'']
            model.keep_rows(live)
            tokens, key_mask, rows, done = tokens[live], key_mask[live], rows[live], done[live]
        logits = model(tokens[:, pos - 1:pos], pos - 1, key_mask=key_mask)[0][:, -1]  # [B', V]
    return [BatchAnswer(out_tokens[b, int(pad[b]):int(lens[b] + pad[b] + n_new[b])].tolist(), int(lens[b]))
            for b in range(bsz)]
