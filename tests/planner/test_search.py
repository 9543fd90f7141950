"""Candidate enumeration, ranking, the report, JSON round trips, and the planner's purity."""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from polybasic.errors import ConfigError
from polybasic.planner.cost import ChainConfig, predict
from polybasic.planner.profile import CostCurve, LevelProfile, PairProfile, Profile
from polybasic.planner.search import SearchSpace, candidate_chains, chain_problem, plan, render_markdown

ROOT = Path(__file__).resolve().parents[2]


def curve(t1, slope, n=12, decode_ms=None):
    """T(M) = t1 + slope (M - 1) for M = 1..n."""
    return CostCurve(tokens=list(range(1, n + 1)), time_ms=[t1 + slope * m for m in range(n)], context=128,
                     prefill_tokens=128, prefill_ms=4 * t1, decode_ms=decode_ms)


def pair(v, d, rate, k=5, fill=1.0):
    return PairProfile(v, d, k=k, verifications=50, mean_accepted_length=1 + rate, rate=rate, draft_fill=fill,
                       histogram={1: 20, 2: 30}, overhead_ms=0.1)


def synthetic() -> Profile:
    """A paper-like set: a fast, close quantized copy (q), a slow 'small model' barely closer than the
    head (s), EAGLE heads on the target and on q, and an n-gram proposer."""
    levels = [LevelProfile("target", "model", curve(22, 0.5, decode_ms=22)),
              LevelProfile("q", "model", curve(4, 0.2)),
              LevelProfile("s", "model", curve(17.6, 0.5)),
              LevelProfile("eagle:t", "eagle", curve(1, 0.05), base="target"),
              LevelProfile("eagle:q", "eagle", curve(1, 0.05), base="q"),
              LevelProfile("ngram", "ngram", curve(0.2, 0.0))]
    pairs = [pair("target", "q", 0.95), pair("target", "s", 0.7), pair("target", "eagle:t", 0.75),
             pair("q", "eagle:q", 0.75), pair("s", "q", 0.8), pair("q", "ngram", 0.5, fill=0.4),
             pair("target", "ngram", 0.45, fill=0.4)]
    return Profile("target", levels, pairs, device="cpu", sampling={"temperature": 0.0})


def test_candidates_respect_constraints():
    prof = synthetic()
    chains = candidate_chains(prof, max_levels=4)
    assert ("target", "q", "eagle:q") in chains and ("target", "eagle:t") in chains
    assert ("target", "s", "q", "ngram") in chains
    for c in chains:
        assert chain_problem(prof, c) is None and c[0] == "target"
        assert "ngram" not in c[:-1]  # only at the bottom
        for i, name in enumerate(c):
            if name.startswith("eagle:"):
                assert i == len(c) - 1 and c[i - 1] == prof.level(name).base
    assert ("target", "eagle:q") not in chains  # a head only below the model it was trained on
    assert ("target", "q", "s") not in chains  # pair q <- s not profiled
    assert "not profiled" in chain_problem(prof, ("target", "q", "s"))
    assert "bottom" in chain_problem(prof, ("target", "ngram", "q"))


def test_search_picks_the_known_best():
    prof = synthetic()
    space = SearchSpace(k_values=[2, 4, 6], thresholds=[2, 4, 6, 8])
    p = plan(prof, space)
    # brute force over every chain, k and threshold tuple: the plan's rows are each chain's best
    # speedup with every level's prefill amortised over new_tokens
    best = {}
    for chain in candidate_chains(prof, space.max_levels):
        for k in space.k_values:
            for ts in itertools.product(space.thresholds, repeat=len(chain) - 2):
                sp = predict(prof, ChainConfig(chain, k, ts), space.new_tokens).speedup
                best[chain] = max(best.get(chain, sp), sp)
    assert {tuple(r.chain): r.speedup for r in p.rows} == best
    assert [r.speedup for r in p.rows] == sorted((r.speedup for r in p.rows), reverse=True)
    assert p.best.chain == ["target", "q", "eagle:q"]  # the paper's chain wins on paper-like numbers
    by_spec = {r.spec: r for r in p.rows}
    assert by_spec["q+eagle:q"].speedup > by_spec["eagle:t"].speedup > 1
    # Theorem 3.2 for the inserted level: s between target and q does not pay, under both forms
    v = by_spec["s+q+ngram"].verdicts[0]
    assert v.level == "s" and not v.exact.pays and not v.paper.pays
    # q inserted above its own head: no two-level reference (the head needs q above it)
    v = by_spec["q+eagle:q"].verdicts[0]
    assert v.exact is None and "EAGLE" in v.note
    assert by_spec["q+ngram"].verdicts[0].exact.pays  # q between target and ngram pays
    assert by_spec["eagle:t"].verdicts == []


def test_a_slow_prefill_ranks_by_the_amortised_speedup():
    """A level with the fastest steps but a prefill 50x the target's loses to one that is slower per
    token but cheap to start: the ranking is the speedup shown (prefill amortised), not steady state."""
    levels = [LevelProfile("target", "model", curve(22, 0.5, decode_ms=22)),
              LevelProfile("fast", "model", CostCurve(list(range(1, 13)), [3 + 0.2 * m for m in range(12)], 128,
                                                      128, 50 * 4 * 22)),
              LevelProfile("cheap", "model", curve(6, 0.3))]
    prof = Profile("target", levels, [pair("target", "fast", 0.95), pair("target", "cheap", 0.9)], "cpu",
                   {"temperature": 0.0})
    p = plan(prof, SearchSpace(k_values=[4], thresholds=[4], new_tokens=128))
    by = {r.spec: r for r in p.rows}
    assert by["fast"].ms_per_token < by["cheap"].ms_per_token  # faster once started
    assert p.best.spec == "cheap" and by["cheap"].speedup > by["fast"].speedup


def test_report_has_one_row_per_candidate():
    prof = synthetic()
    p = plan(prof, SearchSpace(k_values=[3, 5], thresholds=[3, 6], max_levels=3))
    md = render_markdown(p)
    body = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    assert len(body) == len(p.rows) == len(candidate_chains(prof, 3))
    row = next(line for line in body if "`q+ngram`" in line)
    assert "q: pays" in row and "x |" in row


def test_profile_and_plan_json_round_trip(tmp_path):
    prof = synthetic()
    prof.save(tmp_path / "profile.json")
    back = Profile.load(tmp_path / "profile.json")
    assert back == prof
    assert back.pair("target", "q").histogram == {1: 20, 2: 30}  # int keys survive JSON
    p = plan(prof, SearchSpace(k_values=[3], thresholds=[4], max_levels=3))
    p.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert [r["spec"] for r in data["rows"]] == [r.spec for r in p.rows]
    assert data["rows"][0]["speedup"] == p.best.speedup


def test_profile_bad_input(tmp_path):
    d = synthetic().to_dict()
    d["levels"][1]["kind"] = "quantum"
    with pytest.raises(ConfigError, match="kind"):
        Profile.from_dict(d)
    d = synthetic().to_dict()
    d["pairs"][0]["drafter"] = "missing"
    with pytest.raises(ConfigError, match="drafter"):
        Profile.from_dict(d)
    d = synthetic().to_dict()
    d["version"] = 99
    with pytest.raises(ConfigError, match="version"):
        Profile.from_dict(d)
    with pytest.raises(ConfigError, match="does not exist"):
        Profile.load(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="not profiled"):
        predict(synthetic(), ChainConfig(("target", "q", "s"), 3, (4,)))
    with pytest.raises(ConfigError, match="cost.tokens"):
        CostCurve(tokens=[2, 1], time_ms=[1.0, 2.0])


def test_curve_interpolation():
    c = CostCurve(tokens=[1, 2, 4], time_ms=[10.0, 12.0, 13.0])
    assert [c.at(m) for m in (0.5, 1, 1.5, 3, 4, 6)] == [10.0, 10.0, 11.0, 12.5, 13.0, 14.0]


def test_planner_imports_no_torch_nor_runtime():
    code = ("import sys; import polybasic.planner; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'polybasic.runtime', "
            "'polybasic.models', 'polybasic.quant', 'polybasic.drafters'))); assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
