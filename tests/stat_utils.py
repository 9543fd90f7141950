"""Goodness-of-fit helper for the sampling tests (no scipy needed)."""
import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of observed counts against probabilities.

    Categories with expected count < min_expected are pooled into one bin (so the chi-square
    approximation holds). Returns the p-value, P(chi2_df >= statistic).
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < min_expected:  # pooled bin still too small: merge it into the smallest big bin
        j = int(exp[:-1].argmin())
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return 0.0  # observed an outcome of probability zero
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def chain_sample_counts(chain, prompt: list[int], sampling, seed: int, n: int, vocab: int):
    """Counts of the first token [V] and of the 3-token sequence [V, V, V] over n seeded generations."""
    from polybasic.runtime.sampling import make_generator

    g = make_generator(seed, chain.levels[0].model.device)  # where the target's probabilities live
    first, seqs = torch.zeros(vocab), torch.zeros(vocab, vocab, vocab)
    for _ in range(n):
        out, _ = chain.generate(prompt, 3, sampling, g)
        first[out[0]] += 1
        seqs[out[0], out[1], out[2]] += 1
    return first, seqs
