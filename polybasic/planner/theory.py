"""The paper's theory (Wang et al., ICML 2025, section 3) as pure functions. No torch, no runtime.

Notation: levels 1 (target) .. n (smallest); E[L_i] is the mean accepted length (tokens per
verification, accepted drafts + the corrected/bonus token) of the pair whose verifier is M_i; T_i
the forward time of M_i; N tokens to generate; alpha the smallest model's forwards per forward of
the level above it (its draft length k for an autoregressive drafter).

- Lemma 3.1: T = sum_i phi_i T_i with phi_1 = N/E[L_1],
  phi_i = N / (E[L_i] ceil(E[L_{i-1}]/E[L_i])) for 1 < i < n, phi_n = alpha phi_{n-1}.
- Theorem 3.2 (insert M2' between the target M1 and the drafter M2). Two models (Lemma 3.1):
      T_two   = N T1/E[L1] + alpha N T2/E[L1].
  Three models, c = ceil(E[L1]'/E[L2]'):
      T_three = N T1/E[L1]' + N T2'/(c E[L2]') + alpha N T2/(c E[L2]').
  T_three < T_two; divide by N T1 / (c E[L2]') > 0 and move T2'/T1 to the left:
      T2'/T1 < c E[L2]' (1/E[L1] - 1/E[L1]') + alpha (T2/T1) (c E[L2]'/E[L1] - 1).      (exact)
  This is an "if and only if" under Lemma 3.1 and needs no precondition. The paper bounds c below
  by 2 and drops the drafter term (it is >= 0 when c E[L2]' >= E[L1]), which gives its sufficient
  condition T2'/T1 < 2 E[L2]' (1/E[L1] - 1/E[L1]') (form "paper"); the rebuttal's worked numbers use
  the same right-hand side without the factor 2 (form "rebuttal"). The paper's second condition,
  T2'/T2 < alpha (E[L1]/(2E[L2]') - 1), has a negative right-hand side whenever its precondition
  2E[L2]' > E[L1] holds, so it never fires; it is not implemented.
- Theorem 3.3: with speculative sampling and a per-token acceptance rate a (i.i.d.), the accepted
  length of a k-token draft is a capped geometric variable: P(L = l) = a^(l-1) (1-a) for l <= k,
  P(L = k+1) = a^k, mean (1 - a^(k+1)) / (1 - a).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from polybasic.errors import check

FORMS = ("exact", "paper", "rebuttal")


def phi(n_tokens: float, mean_lengths: Sequence[float], alpha: float) -> list[float]:
    """Lemma 3.1's forward counts [phi_1..phi_n] of an n-level chain; mean_lengths = [E[L_1]..E[L_{n-1}]]."""
    check(len(mean_lengths) >= 1, "mean_lengths", "is empty", "give E[L_i] for every level but the smallest")
    for i, e in enumerate(mean_lengths):
        check(e >= 1, f"mean_lengths[{i}]", f"must be >= 1 (a verification yields >= 1 token), got {e}",
              "pass tokens per verification, not accepted drafts only")
    out = [n_tokens / mean_lengths[0]]
    for i in range(1, len(mean_lengths)):
        out.append(n_tokens / (mean_lengths[i] * math.ceil(mean_lengths[i - 1] / mean_lengths[i])))
    out.append(alpha * out[-1])
    return out


def lemma_3_1(phis: Sequence[float], times: Sequence[float]) -> float:
    """Ideal inference time T = sum_i phi_i T_i."""
    check(len(phis) == len(times), "times", f"needs one forward time per level ({len(phis)}), got {len(times)}",
          "give T_i for every level")
    return sum(p * t for p, t in zip(phis, times))


@dataclass(frozen=True)
class Insertion:
    """Theorem 3.2's inputs: the two-model system M1 <- M2 and M2' inserted between them."""

    t1: float  # T1: target forward time
    el1: float  # E[L1]: target over the drafter M2 (two models)
    t2: float  # T2: drafter forward time
    t2_new: float  # T2': inserted model's forward time
    el1_new: float  # E[L1]': target over the inserted model
    el2_new: float  # E[L2]': inserted model over the drafter
    alpha: float = 1.0  # drafter forwards per forward of the level it drafts for

    def __post_init__(self) -> None:
        for name in ("el1", "el1_new", "el2_new"):
            v = getattr(self, name)
            check(v >= 1, name, f"must be >= 1 (tokens per verification), got {v}", "pass mean accepted lengths")
        for name in ("t1", "t2", "t2_new", "alpha"):
            v = getattr(self, name)
            check(v >= 0 and math.isfinite(v), name, f"must be a finite number >= 0, got {v}", "pass measured times")
        check(self.t1 > 0, "t1", "must be > 0", "pass the target's forward time")


@dataclass(frozen=True)
class Verdict:
    """Does inserting the level pay? lhs = T2'/T1 against rhs; pays iff lhs < rhs."""

    form: str  # exact | paper | rebuttal
    lhs: float
    rhs: float
    pays: bool
    preconditions: bool  # the paper's E[L1]' > E[L1] and 2 E[L2]' > E[L1]

    def to_dict(self) -> dict:
        return asdict(self)


def theorem_3_2(x: Insertion, form: str = "exact") -> Verdict:
    """Theorem 3.2 in one of its forms (see the module docstring for the derivation)."""
    check(form in FORMS, "form", f"unknown form {form!r}", f"use one of {FORMS}")
    lhs = x.t2_new / x.t1
    gain = x.el2_new * (1 / x.el1 - 1 / x.el1_new)  # E[L2]' (1/E[L1] - 1/E[L1]')
    if form == "rebuttal":
        rhs = gain
    elif form == "paper":
        rhs = 2 * gain
    else:
        c = math.ceil(x.el1_new / x.el2_new)
        rhs = c * gain + x.alpha * (x.t2 / x.t1) * (c * x.el2_new / x.el1 - 1)
    pre = x.el1_new > x.el1 and 2 * x.el2_new > x.el1
    return Verdict(form, lhs, rhs, lhs < rhs, pre)


def two_vs_three_times(x: Insertion, n_tokens: float = 1.0) -> tuple[float, float]:
    """Lemma 3.1's times (two models, three models): the exact form says pays iff three < two."""
    two = lemma_3_1(phi(n_tokens, [x.el1], x.alpha), [x.t1, x.t2])
    three = lemma_3_1(phi(n_tokens, [x.el1_new, x.el2_new], x.alpha), [x.t1, x.t2_new, x.t2])
    return two, three


def _check_rate(rate: float, k: float) -> None:
    check(0 <= rate <= 1, "rate", f"must be in [0, 1], got {rate}", "pass a per-token acceptance probability")
    check(k >= 0, "k", f"must be >= 0, got {k}", "pass the draft length")


def expected_accepted_length(rate: float, k: float) -> float:
    """Theorem 3.3: mean tokens per verification of a k-token draft, (1 - a^(k+1)) / (1 - a).
    k may be fractional (a mean draft length); the formula is the same."""
    _check_rate(rate, k)
    return k + 1.0 if rate == 1 else (1 - rate ** (k + 1)) / (1 - rate)


def accepted_length_pmf(rate: float, k: int) -> list[float]:
    """P(L = l) for l = 1..k+1 (index l-1): the capped geometric of Theorem 3.3."""
    _check_rate(rate, k)
    return [rate ** (l - 1) * (1 - rate) for l in range(1, k + 1)] + [rate ** k]


def acceptance_rate(mean_length: float, k: float) -> float:
    """Theorem 3.3 inverted: the per-token rate a whose capped geometric has this mean at draft length k."""
    check(k > 0, "k", f"must be > 0, got {k}", "pass the draft length the mean was measured at")
    check(1 <= mean_length <= k + 1, "mean_length", f"must lie in [1, k+1] = [1, {k + 1}], got {mean_length}",
          "pass tokens per verification (accepted drafts + 1) measured at this k")
    if mean_length in (1, k + 1):
        return 0.0 if mean_length == 1 else 1.0
    lo, hi = 0.0, 1.0  # the mean is increasing in a: bisection to float resolution
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_accepted_length(mid, k) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
