"""Vanilla autoregressive decoding with the lean decoder: the baseline every speedup is against."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError, check
from polybasic.models.decoder import Transformer
from polybasic.runtime.context import synchronize
from polybasic.runtime.sampling import check_generator, probs_from_logits, sample


@dataclass
class GenerationStats:
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = ""  # eos | max_new_tokens | context_window
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d["tokens_per_s"] = self.tokens_per_s
        d.update(self.extra)
        return d


def check_request(prompt_ids: list[int], max_new_tokens: int, context: int) -> int:
    """Validate a request; return how many new tokens fit in the context window."""
    check(len(prompt_ids) > 0, "prompt", "is empty", "pass at least one token")
    check(isinstance(max_new_tokens, int) and max_new_tokens > 0, "max_new_tokens",
          f"must be a positive integer, got {max_new_tokens!r}", "pass e.g. --max-new-tokens 128")
    if len(prompt_ids) >= context:
        raise ConfigError(f"prompt: {len(prompt_ids)} tokens do not fit the model's context window of "
                          f"{context} tokens (one more is needed to generate); shorten the prompt")
    return min(max_new_tokens, context - len(prompt_ids))


@torch.inference_mode()
def generate_tokens(model: Transformer, prompt_ids: list[int], max_new_tokens: int,
                    sampling: SamplingConfig = SamplingConfig(), eos: set[int] = frozenset(),
                    generator: torch.Generator | None = None,
                    stats: GenerationStats | None = None) -> Iterator[int]:
    """Yield new tokens one by one (the prompt is not repeated). Fills `stats` as it goes."""
    stats = stats if stats is not None else GenerationStats()
    budget = check_request(prompt_ids, max_new_tokens, model.args.max_seq_len)
    check_generator(None if sampling.greedy else generator, model.device)
    t0 = time.perf_counter()
    model.setup_caches(len(prompt_ids) + budget)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # [1, P]
    logits, _ = model(tokens, 0, last_only=True)  # [1, 1, V]
    synchronize(model.device)  # the prefill's time, not its launch's (CUDA)
    stats.prompt_tokens = len(prompt_ids)
    stats.prefill_s = time.perf_counter() - t0
    pos = len(prompt_ids)
    stats.stop_reason = "max_new_tokens" if budget == max_new_tokens else "context_window"
    for i in range(budget):
        tok = sample(probs_from_logits(logits[0, -1], sampling), generator).item() if not sampling.greedy \
            else int(logits[0, -1].argmax())
        stats.new_tokens += 1
        stats.wall_s = time.perf_counter() - t0
        yield tok
        if tok in eos:
            stats.stop_reason = "eos"
            break
        if i + 1 < budget:
            logits, _ = model(torch.tensor([[tok]], device=model.device), pos, last_only=True)
            pos += 1
    stats.wall_s = time.perf_counter() - t0
