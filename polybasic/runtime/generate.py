"""Vanilla autoregressive decoding with the lean decoder: the baseline every speedup is against."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError, check
from polybasic.models.decoder import Transformer
from polybasic.runtime.context import synchronize
from polybasic.runtime.sampling import argmax, check_generator, probs_from_logits, sample


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
                    stats: GenerationStats | None = None, lookahead: bool | None = None) -> Iterator[int]:
    """Yield new tokens one by one (the prompt is not repeated). Fills `stats` as it goes.

    Each token is picked on the device and fed to the next forward from there. With `lookahead` (default:
    on CUDA) the next forward is queued before the host reads the token, so the device never idles while
    Python yields it; the tokens are the same, and a stop at an EOS leaves one forward computed for nothing
    (its cache row is never read). On the CPU, whose ops run as they are called, lookahead would only
    delay each token by a step, so it is off there."""
    stats = stats if stats is not None else GenerationStats()
    budget = check_request(prompt_ids, max_new_tokens, model.args.max_seq_len)
    check_generator(None if sampling.greedy else generator, model.device)
    ahead = model.device.type == "cuda" if lookahead is None else lookahead
    t0 = time.perf_counter()
    model.setup_caches(len(prompt_ids) + budget)
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # [1, P]
    logits, _ = model(tokens, 0, last_only=True)  # [1, 1, V]
    synchronize(model.device)  # the prefill's time, not its launch's (CUDA)
    stats.prompt_tokens = len(prompt_ids)
    stats.prefill_s = time.perf_counter() - t0
    pos = len(prompt_ids)
    stats.stop_reason = "max_new_tokens" if budget == max_new_tokens else "context_window"
    nxt = pick_token(logits[0, -1], sampling, generator)  # [] on the device
    for i in range(budget):
        more = i + 1 < budget
        host = HostValue(nxt)
        if ahead and more:
            logits, _ = model(nxt.view(1, 1), pos, last_only=True)
        tok = host.get()
        stats.new_tokens += 1
        stats.wall_s = time.perf_counter() - t0
        yield tok
        if tok in eos:
            stats.stop_reason = "eos"
            break
        if more:
            if not ahead:
                logits, _ = model(nxt.view(1, 1), pos, last_only=True)
            pos += 1
            nxt = pick_token(logits[0, -1], sampling, generator)
    stats.wall_s = time.perf_counter() - t0


def pick_token(logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> Tensor:
    """logits [..., V] -> the next tokens [...] on their device: the argmax, or a draw from the processed
    distribution (sampling.argmax: torch's CPU argmax over Qwen's 151,936 bf16 logits took 0.50 ms, this 0.016, on an
    AMD EPYC family 26, 2026-11-29)."""
    return argmax(logits) if sampling.greedy else sample(probs_from_logits(logits, sampling), generator)


class HostValue:
    """A device scalar's value copied to the host without waiting for the work queued after it: on CUDA
    the copy goes to pinned memory and `get` waits for it alone (an event), not for the whole queue."""

    def __init__(self, t: Tensor) -> None:
        self.event = None
        if t.device.type == "cuda":
            self.t = t.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.t = t

    def get(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.t)
