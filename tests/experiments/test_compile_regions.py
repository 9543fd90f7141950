"""`python -m experiments.compile_regions`: compiled steps as one graph against one graph per layer, side by side."""
import json

from experiments import compile_regions
from tests.helpers import tiny_hf_folder


def test_both_modes_compile_and_give_the_same_bits(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=128, heads=4, kv_heads=2, layers=3)  # head size 32
    compile_regions.main(["--model", str(tmp_path / "tiny"), "--dtype", "bfloat16", "--sizes", "1,2",
                          "--length", "64", "--prompt", "10", "--reps", "2", "--json", str(tmp_path / "r.json")])
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["compile"]) == {"whole", "regions:1"}
    for c in data["compile"].values():
        assert c["cold_s"] > 0 and c["warm_s"] > 0 and c["graphs"] >= 1
    # 3 layers: the whole model's graph per size against one layer's, run by all three
    assert data["steps"].keys() == {"1", "2"} and all(s["bit_equal"] for s in data["steps"].values())
    assert "| regions:1 |" in capsys.readouterr().out


def test_steps_through_the_wrappers_beside_straight_calls(tmp_path):
    """--wrapped times each mode's steps with and without straight calls (models.static.GraphCall): same bits."""
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=128, heads=4, kv_heads=2, layers=2)
    compile_regions.main(["--model", str(tmp_path / "tiny"), "--dtype", "bfloat16", "--sizes", "1,2", "--length", "64",
                          "--prompt", "10", "--reps", "6", "--wrapped", "--steady-only", "--json", str(tmp_path / "r.json")])
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["compile"] == {}
    for s in data["steps"].values():
        assert {"whole_ms", "whole wrapped_ms", "regions:1_ms", "regions:1 wrapped_ms"} <= s.keys() and s["bit_equal"]
