"""The oracle level (experiments.oracle): a chain over it emits the target's greedy tokens, its accepted lengths
follow the set rate (the premise of the efficiency it measures), and the planner's pair for it is exact."""
import pytest
import torch

from experiments.oracle import OracleLevel, build, depth_rate, oracle_pair, plan_oracle
from polybasic.planner.profile import CostCurve
from polybasic.runtime.chain import Chain
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from tests.stat_utils import chi_square_pvalue


@pytest.fixture(scope="module")
def tiny():
    return build("tiny", max_seq_len=512)


@pytest.mark.parametrize("width, k", [(1, 4), (3, 2)])
def test_a_chain_over_the_oracle_is_lossless_and_accepts_at_the_set_rate(tiny, width, k):
    """Greedy identity, and the accepted lengths of full drafts against the capped geometric law at the set rate
    (chi-square, p > 1e-3), which a rate 0.15 off fails."""
    rate, full = 0.5, []
    for seed in range(5):
        prompt = torch.randint(2, 500, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = list(generate_tokens(tiny, prompt, 400, eos=set()))
        oracle = OracleLevel(prompt + ref, [rate], width, seed=seed, vocab_size=tiny.args.vocab_size)
        out, stats = Chain([ModelLevel(tiny, "target"), oracle], k=k).generate(prompt, 400)
        assert out == ref
        link = stats.links[0]
        full += [a for a, d in zip(link.accepted, link.drafted) if d == k * width]  # not cut by the budget
    counts = torch.bincount(torch.tensor(full), minlength=k + 1).double()

    def law(r):
        a = depth_rate([r], width)
        return torch.tensor([a ** n * (1 - a) for n in range(k)] + [a ** k], dtype=torch.float64)
    assert chi_square_pvalue(counts, law(rate)) > 1e-3
    assert chi_square_pvalue(counts, law(rate + 0.15)) < 1e-3


def test_the_planner_pair_and_choice():
    pair = oracle_pair([0.5], 2, 3, "oracle/2")
    assert pair.rate == pytest.approx(0.75) and pair.nodes == 6 and pair.tree_width == 2
    assert pair.mean_accepted_length == pytest.approx(1 + 0.75 + 0.75 ** 2 + 0.75 ** 3)
    flat = CostCurve(list(range(1, 20)), [10.0] * 19, decode_ms=10.0)  # a verification costs one step: wide wins
    best = plan_oracle(flat, 0.0, [0.5], [1, 2, 3], [1, 2, 3])
    assert best[0][1:3] == (3, 3) and best[0][0] == pytest.approx(best[0][3].tau)
