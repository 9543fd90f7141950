"""The speculative-sampling rule on its own: exact in greedy mode, distribution-preserving when sampling."""
import torch

from polybasic.runtime.sampling import argmax
from polybasic.runtime.verify import speculative_verify
from tests.stat_utils import chi_square_pvalue


def test_greedy_accepts_prefix_then_corrects():
    p = torch.eye(8)[[1, 2, 3, 4]]  # verifier argmax: 1, 2, 3, then 4 (bonus position)
    draft = torch.tensor([1, 2, 5])
    q = torch.eye(8)[draft]
    assert speculative_verify(draft, q, p, greedy=True) == (2, 3)
    assert speculative_verify(torch.tensor([1, 2, 3]), torch.eye(8)[[1, 2, 3]], p, greedy=True) == (3, 4)
    assert speculative_verify(torch.tensor([], dtype=torch.long), torch.empty(0, 8), p[:1], greedy=True) == (0, 1)


def test_zero_probability_draft_is_never_accepted():
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, tok = speculative_verify(torch.tensor([0]), q, p, greedy=False, generator=g)
        assert (n, tok) == (0, 1)


def test_first_token_is_distributed_as_verifier():
    g = torch.Generator().manual_seed(1)
    V, N = 6, 20000
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    counts = torch.zeros(V)
    for _ in range(N):
        d = torch.multinomial(q[0], 1, generator=g)
        n, tok = speculative_verify(d, q, p, greedy=False, generator=g)
        counts[int(d) if n == 1 else tok] += 1
    assert chi_square_pvalue(counts, p[0]) > 1e-3
    # the draft distribution itself is far from p: the same test rejects it
    assert chi_square_pvalue(counts, q[0]) < 1e-3


def test_argmax_gives_torchs_indices_for_ties_nans_and_every_dtype():
    """sampling.argmax (NumPy's on the CPU) must pick what torch.argmax picks: the first maximum, a NaN first."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randint(-3, 3, (4, 1 + 37 * trial), generator=g).float()  # many ties
        x[0, trial % x.shape[1]] = float("nan")
        x[1] = float("-inf")
        x[2, ::2] = -0.0  # equal to 0.0
        assert int(argmax(x)[0]) == trial % x.shape[1]
        for t in (x, x.bfloat16(), x.half(), x[:, ::2]):  # and a strided view
            want = t.argmax(-1)
            assert torch.equal(argmax(t), want)
            assert [int(argmax(row)) for row in t] == want.tolist()
