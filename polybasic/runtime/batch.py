"""Batched generation with left padding: many prompts answered in one decode loop.

Used where throughput matters more than latency (self-distillation data for drafters). Every row
gets the same number of cache slots; row b's prompt is right-aligned and the slots before it are
masked out, so (RoPE being relative) each row computes what it would alone, up to float rounding.
Besides the tokens, the loop keeps the last hidden state of every position: the features a
drafter learns from, computed once, for free.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from polybasic.models.llama import Transformer
from polybasic.runtime.generate import check_request
from polybasic.runtime.sampling import SamplingConfig, probs_from_logits, sample


@dataclass
class BatchAnswer:
    tokens: list[int]  # prompt + answer (EOS included when it was generated)
    n_prompt: int
    hidden: Tensor | None  # [len(tokens), E] last hidden states (before the final norm), or None


@torch.inference_mode()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int,
                   sampling: SamplingConfig = SamplingConfig(), eos: set[int] = frozenset(),
                   generator: torch.Generator | None = None, keep_hidden: bool = False) -> list[BatchAnswer]:
    """Answer every prompt (one batch; sort prompts by length first to waste less padding).

    A row stops at EOS or after max_new_tokens; the loop ends when every row has stopped.
    keep_hidden: also return each position's hidden state (costs one more decode step).
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
    logits, hidden = model(tokens[:, :width], 0, key_mask=key_mask)  # [B, W, V], [B, W, E]
    hid = [hidden] if keep_hidden else []
    logits = logits[:, -1]  # [B, V]
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    n_new = torch.zeros(bsz, dtype=torch.long, device=dev)  # answer length per row
    eos_t = torch.tensor(sorted(eos), dtype=torch.long, device=dev)
    pos = width
    for step in range(budget):
        nxt = logits.argmax(-1) if sampling.greedy else sample(probs_from_logits(logits, sampling), generator)
        tokens[:, pos] = torch.where(done, tokens[:, pos], nxt)  # [B]
        n_new += (~done).long()
        done |= torch.isin(nxt, eos_t)
        pos += 1
        if bool(done.all()) or step == budget - 1:
            break
        logits, h = model(tokens[:, pos - 1:pos], pos - 1, key_mask=key_mask)  # [B, 1, V], [B, 1, E]
        logits = logits[:, -1]
        hid.extend([h] if keep_hidden else [])
    if keep_hidden:  # the newest tokens' hidden states
        hid.append(model(tokens[:, pos - 1:pos], pos - 1, key_mask=key_mask)[1])
    hidden = torch.cat(hid, 1) if keep_hidden else None  # [B, pos, E]
    out = []
    for b in range(bsz):
        lo, n = int(pad[b]), int(lens[b] + n_new[b])
        out.append(BatchAnswer(tokens[b, lo:lo + n].tolist(), int(lens[b]),
                               hidden[b, lo:lo + n].clone() if keep_hidden else None))
    return out
