"""`python -m experiments.chains_on_prompts`: compiled chains beside compiled plain decoding on a data set's last
prompts."""
import json

from experiments import chains_on_prompts
from tests.helpers import tiny_hf_folder


def test_chains_run_beside_plain_decoding(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=128, heads=4, kv_heads=2, layers=2)  # head size 32
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"say {i} {i} {i}", "input": "", "output": "x"} for i in range(5)]))
    totals = chains_on_prompts.main(["--model", str(tmp_path / "tiny"), "--data", str(data), "--prompts", "2",
                                     "--max-new-tokens", "12", "--sizes", "1,2,4,8,64",
                                     "--chains", "target@bfloat16:2,target@bfloat16|ngram:2"])
    assert len(totals) == 3 and all(t["tokens"] > 0 and t["forwards"] > 0 for t in totals.values())
    assert totals["target@bfloat16|ngram k=2"]["identical"] == 2  # a bf16 copy of a bf16 target: lossless
    assert "| target@bfloat16\\|ngram k=2 |" in capsys.readouterr().out


def test_tree_cost_times_paths_and_trees(tmp_path, capsys):
    """`python -m experiments.tree_cost`: compiled verifications of M rows as paths and as trees of the same rows."""
    from experiments import tree_cost

    assert tree_cost.tree_of(5) == [-1, 0, 1, 0, 3] and tree_cost.tree_of(2) == [-1, 0]
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=128, heads=4, kv_heads=2, layers=2)
    out = tree_cost.main(["--model", str(tmp_path / "tiny"), "--sizes", "1,2,4,8,64", "--rows", "1,5",
                          "--context", "20", "--reps", "2", "--spells", "0.5"])
    assert out[1]["tree_ms"] is None and out[5]["path_ms"] > 0 and out[5]["tree_ms"] > 0
    assert len(out["spells"]) == 4 and all(t1 > 0 and len(r) == 1 and r[0] > 0 for t1, r in out["spells"])
    text = capsys.readouterr().out
    assert "| 5 |" in text and "| quarter | T(1) | T(5)/T(1) |" in text


def test_tree_cost_quarters_sort_rounds_by_their_one_row_time():
    from experiments.tree_cost import quarters

    rounds = [[t1, 2 * t1 if t1 < 5 else t1] for t1 in (8, 1, 7, 2, 6, 3, 5, 4)]  # fast rounds: 2 rows cost double
    assert quarters(rounds) == [(1.5, [2.0]), (3.5, [2.0]), (5.5, [1.0]), (7.5, [1.0])]
    assert quarters([[2.0, 3.0], [4.0, 4.0]]) == [(3.0, [1.25])]  # too few rounds for quarters: one group
