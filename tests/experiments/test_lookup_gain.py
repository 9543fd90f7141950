"""`python -m experiments.lookup_gain`: what prompt lookup's continuation adds to a drafter's trees, by match length."""
from experiments import lookup_gain
from tests.helpers import tiny_hf_folder


def test_match_length_is_the_longest_ngram_with_a_continuation():
    assert lookup_gain.match_length([1, 2, 3, 9, 1, 2], 3) == 2  # "1 2" occurred, followed by 3
    assert lookup_gain.match_length([1, 2, 3, 9, 2, 3], 3) == 2
    assert lookup_gain.match_length([4, 1, 2, 3, 4, 1, 2, 3], 3) == 3
    assert lookup_gain.match_length([5, 6, 7], 3) == 0 and lookup_gain.match_length([5], 3) == 0


def test_the_driver_counts_the_lookups_nodes_and_what_they_won(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2, init_std=0.2)
    tiny = str(tmp_path / "tiny")
    stats = lookup_gain.main(["--model", tiny, "--dtype", "float32", "--drafter", f"{tiny}@bfloat16",
                              "--data", "work-mix-48", "--last", "2", "--tokens", "24", "--k", "3"])
    assert "| match | verifications |" in capsys.readouterr().out
    assert sum(v for v, *_ in stats.values()) > 0
    for n, (v, nodes, won, wins) in stats.items():
        assert 0 <= wins <= v and 0 <= won <= nodes  # a node wins at most its token
        assert n > 0 or nodes == 0  # no match: the drafter's path alone
