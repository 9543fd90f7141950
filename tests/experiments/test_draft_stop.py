"""`python -m experiments.draft_stop`: a chain's draft lengths and confidence stops, checked against vanilla."""
from experiments import draft_stop
from tests.helpers import tiny_hf_folder


def test_sweep_prints_every_config_and_matches_vanilla(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2, init_std=0.2)
    tiny = str(tmp_path / "tiny")
    draft_stop.main(["--model", tiny, "--dtype", "float32", "--chain", f"{tiny}@bfloat16", "--configs",
                     "4:0/8:0.5", "--tokens", "12", "--eager", "--vanilla", "--prefill"])  # asserts identity per prompt
    table = capsys.readouterr().out
    for row in ("| vanilla |", "| k=4 confidence=0.0 thresholds=None |", "| k=8 confidence=0.5 thresholds=None |",
                "| prefill alone | "):
        assert row in table
    assert " s for 4 prompts |" in table  # the four built-in prompts' prefills


def test_two_chains_side_by_side_each_with_its_configs(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "tiny", vocab=64, hidden=64, heads=4, kv_heads=2, init_std=0.2)
    tiny = str(tmp_path / "tiny")
    two, three = f"{tiny}@bfloat16", f"{tiny}@bfloat16+ngram"
    draft_stop.main(["--model", tiny, "--dtype", "float32", "--chain", two, "--configs", "4:0", "--chain", three,
                     "--configs", "2:0:4", "--tokens", "12", "--eager", "--vanilla"])
    table = capsys.readouterr().out
    assert f"| k=4 confidence=0.0 thresholds=None {two} |" in table
    assert f"| k=2 confidence=0.0 thresholds=[4] {three} |" in table


def test_config_spelling():
    assert draft_stop.parse_config("16:0.5") == (16, 0.5, None)
    assert draft_stop.parse_config("1:0.5:16,8") == (1, 0.5, [16, 8])
