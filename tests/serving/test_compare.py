"""serve-check's pure parts: identity, first differences, vLLM's acceptance length, the JSON summary's
keys and checks, the markdown report (no torch, no vLLM)."""
import json

import pytest

from polybasic.serving.compare import (NEAR_TIE, OURS, OURS_CHAIN, VLLM, VLLM_SPEC, acceptance_length, differences,
                                       first_difference, identical_counts, markdown, summary, tokens_per_s, within)

PROMPTS = [{"question_id": i, "category": c, "prompt_tokens": 10} for i, c in enumerate(["writing", "math", "qa"])]


def run(tokens, wall=1.0, **kw):
    return {"tokens": tokens, "wall_s": wall, **kw}


def spec_run(tokens, drafts, accepted, wall=0.5):
    return run(tokens, wall, spec={"num_drafts": drafts, "num_draft_tokens": 3 * drafts,
                                   "num_accepted_tokens": accepted, "accepted_per_pos": []})


@pytest.mark.parametrize("a, b, want", [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1),
                                        ([1, 2], [1, 2, 3], 2), ([], [], None), ([4], [], 0)])
def test_first_difference(a, b, want):
    assert first_difference(a, b) == want


def test_acceptance_length_is_tokens_per_verification():
    assert acceptance_length(10, 15) == 2.5 and acceptance_length(4, 0) == 1.0
    assert acceptance_length(0, 0) is None  # no drafts (vanilla)


def test_within_ten_percent():
    assert within(1.65, 1.5) is True and within(1.36, 1.5) is True and within(1.34, 1.5) is False
    assert within(None, 1.5) is None and within(1.5, None) is None


def test_tokens_per_s_is_total_tokens_over_total_time():
    assert tokens_per_s([run([1] * 10, 1.0), run([1] * 30, 3.0)]) == 10.0
    assert tokens_per_s([]) is None


def _runs():
    return {OURS: [run([1, 2, 3]), run([4, 5, 6]), run([7, 8])],
            OURS_CHAIN: [run([1, 2, 3], 0.5), run([4, 5, 6], 0.5), run([7, 8], 0.5)],
            VLLM: [run([1, 2, 3], 0.25), run([4, 5, 9], 0.25), run([7, 8], 0.25)],
            VLLM_SPEC: [spec_run([1, 2, 3], 2, 2), spec_run([4, 5, 9], 2, 1), spec_run([7, 8], 1, 1)]}


def test_identity_and_differences_name_the_pair_prompt_position_and_tokens():
    outputs = {k: [r["tokens"] for r in v] for k, v in _runs().items()}
    assert identical_counts(outputs) == {"vllm-eagle3 vs vllm": 3, "vllm vs ours": 2, "vllm-eagle3 vs ours": 2,
                                         "ours-eagle3 vs ours": 3}
    diffs = differences(PROMPTS, outputs)
    assert [(d["pair"], d["question_id"], d["category"], d["position"], d["tokens"]) for d in diffs] == [
        ("vllm vs ours", 1, "math", 2, [9, 6]), ("vllm-eagle3 vs ours", 1, "math", 2, [9, 6])]
    # a run that did not happen (no head: no chain) is left out, not counted as different
    del outputs[OURS_CHAIN]
    assert "ours-eagle3 vs ours" not in identical_counts(outputs)


def test_summary_has_the_keys_and_the_checks():
    doc = summary(PROMPTS, _runs(), k=3, vllm_spec={"num_drafts": 5, "num_accepted_tokens": 4}, our_tau=1.7,
                  our_accept_len=1.75, config={"max_new_tokens": 3, "threads": 2}, machine={"cpu": "X"})
    assert {"prompts", "identical", "vllm_acceptance", "our_tau", "tokens_per_s", "checks"} <= doc.keys()
    assert doc["prompts"] == 3 and doc["vllm_acceptance"] == pytest.approx(1.8)
    assert doc["tokens_per_s"][VLLM] == pytest.approx(8 / 0.75) and doc["speedup"][OURS] == 1.0
    assert doc["speedup"][OURS_CHAIN] == pytest.approx(2.0) and doc["speedup"][VLLM_SPEC] == pytest.approx(0.5)
    assert doc["checks"] == {"vllm_eagle3_identical_to_vllm": True, "acceptance_within_10pct_of_our_tau": True,
                             "acceptance_within_10pct_of_our_accept_len": True}
    assert doc["per_prompt"][0]["vllm_accept_len"] == 2.0 and doc["per_prompt"][2]["ours_tokens"] == 2
    json.dumps(doc)  # JSON-able as written
    text = markdown(doc)
    assert "| vLLM eagle3 (the exported head) |" in text and "| vllm vs ours | 2/3 |" in text
    assert "vLLM's acceptance length 1.800; our tau 1.700" in text


def test_a_spec_difference_passes_only_as_a_near_tie_and_only_once():
    runs = _runs()
    runs[VLLM_SPEC][0] = spec_run([1, 7, 3], 2, 0)
    outputs = {k: [r["tokens"] for r in v] for k, v in runs.items()}
    diffs = differences(PROMPTS, outputs)
    spec = [d for d in diffs if d["pair"] == "vllm-eagle3 vs vllm"]
    assert len(spec) == 1 and spec[0]["position"] == 1
    tie = [{**d, "gap": NEAR_TIE / 10, "top2_gap": NEAR_TIE / 10} for d in diffs]
    wide = [{**d, "gap": 3.0, "top2_gap": 3.0} for d in diffs]
    kw = dict(k=3, vllm_spec={"num_drafts": 5, "num_accepted_tokens": 0}, our_tau=2.0, our_accept_len=2.0)
    assert summary(PROMPTS, runs, gaps=tie, **kw)["checks"]["vllm_eagle3_identical_to_vllm"] is True
    doc = summary(PROMPTS, runs, gaps=wide, **kw)
    assert doc["checks"]["vllm_eagle3_identical_to_vllm"] is False
    assert doc["checks"]["acceptance_within_10pct_of_our_tau"] is False  # 1.0 against 2.0
    assert "| 0 (writing) | vllm-eagle3 vs vllm | 1 | 7 / 2 | 3.0000 | 3.0000 |" in markdown(doc)
    runs[VLLM_SPEC][1] = spec_run([4, 1, 9], 2, 0)  # two prompts differ: fails even as near-ties
    gaps = [{**d, "gap": 0.0} for d in differences(PROMPTS, {k: [r["tokens"] for r in v] for k, v in runs.items()})]
    assert summary(PROMPTS, runs, gaps=gaps, **kw)["checks"]["vllm_eagle3_identical_to_vllm"] is False


def test_without_our_chain_the_acceptance_checks_are_not_run():
    runs = _runs()
    del runs[OURS_CHAIN]
    doc = summary(PROMPTS, runs, k=3, vllm_spec={"num_drafts": 5, "num_accepted_tokens": 4}, our_tau=None,
                  our_accept_len=None)
    assert doc["checks"]["acceptance_within_10pct_of_our_tau"] is None and doc["our_tau"] is None
    assert "our tau -" in markdown(doc)
