"""Speculative sampling: the accept / correct rule that keeps every chain level lossless.

Glossary
- draft tokens: tokens proposed by the level below, each sampled from that level's distribution q.
- accepted tokens: the longest prefix of the draft that survives the rule below.
- corrected token: on the first rejection, a token sampled from norm(max(0, p - q)) at that position.
- bonus token: when the whole draft is accepted, one extra token sampled from p after it.
Every verification therefore yields `n_accepted + 1` tokens, each an exact sample of the verifier's
distribution p (Leviathan et al. 2023). Greedy decoding is the same rule with one-hot p and q.
"""
from __future__ import annotations

import torch
from torch import Tensor

from polybasic.runtime.sampling import argmax, sample


def speculative_verify(draft: Tensor, q: Tensor, p: Tensor, greedy: bool,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """Verify a draft against the verifier's distributions.

    draft [k] token ids; q [k, V] proposal distributions the draft was sampled from;
    p [k+1, V] the verifier's distributions at the k draft positions and one past them.
    Returns (n_accepted, next_token) where next_token is the corrected or bonus token.
    """
    k = draft.shape[0]
    if greedy:  # one-hot p and q: accept while the draft equals the verifier's argmax
        target = argmax(p)  # [k+1]
        mismatch = (target[:k] != draft).nonzero()
        n = int(mismatch[0]) if mismatch.numel() else k
        return n, int(target[n])
    if k:
        idx = torch.arange(k, device=draft.device)
        px, qx = p[idx, draft], q[idx, draft]  # [k]
        u = torch.rand(k, generator=generator, device=p.device)
        # accept x with probability min(1, p(x)/q(x)); strict '<' so p(x)=0 is never accepted
        rejected = (u * qx >= px).nonzero()
        n = int(rejected[0]) if rejected.numel() else k
    else:
        n = 0
    return n, int(sample(residual(p[n], q[n]) if n < k else p[k], generator))


def residual(p: Tensor, q: Tensor, fallback: Tensor | None = None) -> Tensor:
    """After a rejection: norm(max(0, p - q)) [V], the distribution the corrected token is drawn from; `fallback`
    (default p) where p - q is nowhere positive (a rejection then had probability 0, up to rounding)."""
    r = (p - q.to(p.device)).clamp_min_(0)  # [V]
    total = r.sum()
    return r / total if total > 0 else (p if fallback is None else fallback)
