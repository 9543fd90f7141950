"""Interleaving and Spec-Bench aggregation math (fake runners, no model)."""
import pytest

from polybasic.bench.methods import Output
from polybasic.bench.runner import Record, fastest_vanilla, run_all, summarize


def fake_runners(calls):
    def make(name, n_tokens, wall, tau=None):
        def run(ids, seed):
            calls.append((name, tuple(ids), seed))
            return Output(list(range(n_tokens)), wall, tau)
        return run
    return {"vanilla": make("vanilla", 4, 2.0), "a": make("a", 4, 1.0, 2.0), "b": make("b", 3, 1.0)}


def test_rotation_warmup_and_seeds():
    calls = []
    prompts = [(i, "c", [i]) for i in range(4)]
    records = run_all(fake_runners(calls), prompts, seed=10, warmup=2, progress=False)
    warm, timed = calls[:6], calls[6:]
    assert [c[0] for c in warm] == ["vanilla", "a", "b"] * 2
    assert [c[0] for c in timed] == ["vanilla", "a", "b", "a", "b", "vanilla", "b", "vanilla", "a",
                                     "vanilla", "a", "b"]
    assert all(c[2] == 10 + c[1][0] for c in timed)  # same seed for every method on a prompt
    assert len(records) == 12 and {r.method for r in records} == {"vanilla", "a", "b"}


def test_repeat_interleaves_rounds_and_keeps_the_fastest_run():
    """With repeat N every method runs N times on a prompt, each round rotated once more; one record per method
    and prompt holds the least wall time and every run's."""
    calls, walls = [], iter([3.0, 1.0, 2.0] * 10)

    def run(name):
        def go(ids, seed):
            calls.append(name)
            return Output([seed, 1], next(walls), None)
        return go
    records = run_all({"vanilla": run("vanilla"), "a": run("a")}, [(0, "c", [0]), (1, "c", [1])], warmup=0,
                      progress=False, repeat=3)
    assert calls == ["vanilla", "a", "a", "vanilla", "vanilla", "a", "a", "vanilla", "vanilla", "a", "a", "vanilla"]
    assert [(r.method, r.question_id) for r in records] == [("vanilla", 0), ("a", 0), ("a", 1), ("vanilla", 1)]
    assert [r.walls for r in records[:2]] == [[3.0, 3.0, 1.0], [1.0, 2.0, 2.0]]
    assert [r.wall_s for r in records] == [1.0] * 4 and records[2].tokens == [1, 1]
    once = run_all({"vanilla": run("vanilla")}, [(0, "c", [0])], warmup=0, progress=False)
    assert once[0].walls is None  # one run: nothing more to keep


def test_repeat_refuses_a_method_whose_runs_differ():
    outs = iter([Output([1, 2], 1.0, None), Output([1, 3], 1.0, None)])
    with pytest.raises(RuntimeError, match="method x: its runs on question 7 .* made different tokens"):
        run_all({"x": lambda ids, seed: next(outs)}, [(7, "qa", [0])], warmup=0, progress=False, repeat=2)


def rec(method, qid, cat, n, wall, tau=None, tokens=None):
    return Record(method, qid, cat, 5, n, wall, tau, tokens if tokens is not None else list(range(n)))


def test_summary_math():
    records = [
        rec("vanilla", 1, "x", 10, 2.0), rec("vanilla", 2, "y", 30, 2.0),
        rec("m", 1, "x", 10, 1.0, tau=2.0), rec("m", 2, "y", 30, 3.0, tau=3.0, tokens=[9] * 30),
    ]
    s = summarize(records, greedy=True)
    assert s["vanilla"]["tokens_per_s"] == pytest.approx(10.0)  # 40 tokens / 4 s, not mean of rates
    assert s["m"]["tokens_per_s"] == pytest.approx(10.0)
    assert s["m"]["speedup"] == pytest.approx(1.0)
    assert s["m"]["tau"] == pytest.approx(40 / (5 + 10))  # tokens / target forwards
    assert s["vanilla"]["tau"] is None and s["vanilla"]["identical_to_vanilla"] == "2/2"
    assert s["m"]["identical_to_vanilla"] == "1/2"
    assert s["m"]["predicted_speedup"] is None
    assert s["m"]["median_speedup"] == pytest.approx((2.0 + 10 / 15) / 2)
    x, y = s["m"]["per_category"]["x"], s["m"]["per_category"]["y"]
    assert x["speedup"] == pytest.approx(2.0) and y["speedup"] == pytest.approx((30 / 3) / (30 / 2))
    assert x["identical_to_vanilla"] == "1/1" and y["identical_to_vanilla"] == "0/1"
    assert x["tau"] == pytest.approx(2.0) and x["prompts"] == 1


def test_bottom_link_accepted_length():
    v = [rec("vanilla", 1, "x", 4, 1.0), rec("vanilla", 2, "y", 4, 1.0)]
    m = [rec("m", 1, "x", 4, 1.0, tau=2.0), rec("m", 2, "y", 4, 1.0, tau=1.0)]
    m[0].accepted, m[1].accepted = [3, 0, 1], [0]  # accepted drafts per verification
    s = summarize(v + m, greedy=True)
    assert s["m"]["accept_len"] == pytest.approx(1 + 4 / 4)  # pooled over verifications, +1 bonus
    assert s["m"]["per_category"]["x"]["accept_len"] == pytest.approx(1 + 4 / 3)
    assert s["m"]["per_category"]["y"]["accept_len"] == pytest.approx(1.0)
    assert s["vanilla"]["accept_len"] is None


def test_sampling_has_no_identity_count():
    s = summarize([rec("vanilla", 1, "x", 3, 1.0), rec("m", 1, "x", 3, 1.0)], greedy=False)
    assert s["m"]["identical_to_vanilla"] is None
    assert s["m"]["per_category"]["x"]["identical_to_vanilla"] is None


def test_every_link_accepted_length():
    v = [rec("vanilla", 1, "x", 4, 1.0), rec("vanilla", 2, "y", 4, 1.0)]
    m = [rec("m", 1, "x", 4, 1.0, tau=2.0), rec("m", 2, "y", 4, 1.0, tau=1.0)]
    m[0].links = {"target<-a": [2, 1], "a<-ngram": [3, 0, 1]}
    m[1].links = {"target<-a": [0], "a<-ngram": []}
    s = summarize(v + m, greedy=True)
    assert s["m"]["links"] == {"target<-a": pytest.approx(1 + 3 / 3), "a<-ngram": pytest.approx(1 + 4 / 3)}
    assert s["vanilla"]["links"] is None
    assert "links" not in s["m"]["per_category"]["x"]  # overall only
    r = rec("n", 1, "x", 4, 1.0, tau=1.0)  # a link with no verifications has no mean
    r.links = {"target<-ngram": []}
    assert summarize(v[:1] + [r], greedy=True)["n"]["links"] == {"target<-ngram": None}


def test_speedup_against_the_fastest_vanilla():
    records = [rec("vanilla", 1, "x", 10, 2.0), rec("vanilla:bfloat16", 1, "x", 10, 1.0),
               rec("vanilla-compiled", 1, "x", 10, 1.25), rec("m", 1, "x", 10, 0.5),
               rec("hf", 1, "x", 10, 0.4)]  # hf is faster than every vanilla but is not one
    s = summarize(records, greedy=True)
    assert fastest_vanilla(s) == "vanilla:bfloat16"
    assert s["m"]["speedup"] == pytest.approx(4.0)
    assert s["m"]["speedup_vs_fastest_vanilla"] == pytest.approx(2.0)
    assert s["vanilla"]["speedup_vs_fastest_vanilla"] == pytest.approx(0.5)
    assert s["vanilla:bfloat16"]["speedup_vs_fastest_vanilla"] == pytest.approx(1.0)
    assert s["vanilla-compiled"]["speedup_vs_fastest_vanilla"] == pytest.approx(0.8)
    assert s["hf"]["speedup_vs_fastest_vanilla"] == pytest.approx(2.5)
    assert fastest_vanilla({"m": {"tokens_per_s": 1.0}}) is None
