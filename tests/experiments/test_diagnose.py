"""The drafter diagnostic: the draft-start walk by hand, and its mean accepted length equal to the
real 2-level greedy chain's (Chain([ModelLevel(base), EagleLevel(head)])) on a tiny model."""
import json
from collections import Counter

import pytest
import torch

from experiments.diagnose import (
    accepted_prefix,
    diagnose,
    draft_start_acceptance,
    main,
    sequence_drafts,
    walk,
    walk_draft_starts,
)
from polybasic.errors import ConfigError
from polybasic.models.eagle_head import DrafterConfig, EagleHead, save_head
from polybasic.runtime.chain import Chain
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel
from tests.helpers import lean_from_hf, tiny_hf_folder, tiny_hf_llama

T, F = True, False


def test_walk_by_hand():
    assert accepted_prefix([T, T, F, T]) == 2 and accepted_prefix([]) == 0
    rows = [[T, T, T],  # index 0: the target's own first token (from its prefill), never drafted
            [T, T, F],  # start 1: a=2 -> next start 4
            [F, F, F], [T, T, T],  # never drafted from
            [F, T, T],  # start 4: a=0 -> 5
            [T, T, T],  # start 5: a=3 (full) -> 9
            [F], [F], [F],
            [T],  # start 9: a=1 (a draft capped to 1 token) -> 11
            [F],
            []]  # start 11: the last token, no draft (budget left 1): length 1 -> 12, done
    assert walk_draft_starts(rows) == [1, 3, 1, 4, 2, 1]
    assert [s for s, _ in walk(rows)] == [0, 1, 4, 5, 9, 11]
    assert walk_draft_starts([[F]]) == [1] and walk_draft_starts([]) == []


def _world(c: float = 0.003):
    """A 1-layer base and a head that is nearly the base (its block is the base's layer, its fuse
    layer passes the token embedding on, plus c times a random map of the feature): drafts of every
    length, and the features still decide some of them."""
    base = lean_from_hf(tiny_hf_llama(seed=3, vocab=128, init_std=0.2, layers=1))
    torch.manual_seed(0)
    head = EagleHead(DrafterConfig.for_base(base.args, input_norms=False, feature_residual=False))
    head.bind(base).init_from_base(base).eval().requires_grad_(False)
    e = base.args.dim
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(e), c * torch.randn(e, e) / e ** 0.5], 1))
        head.fc.bias.zero_()
    return base, head


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (3 + i % 5,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("k", [3, 5])
def test_draft_starts_equal_the_real_chain(k):
    base, head = _world()
    budget, seqs, chain_acc = 40, [], []
    for prompt in _prompts(12):
        answer = list(generate_tokens(base, prompt, budget))
        seqs.append((prompt + answer, len(prompt)))
        tl = ModelLevel(base, "target")
        out, st = Chain([tl, EagleLevel(head, tl)], k=k).generate(prompt, budget)
        assert out == answer  # lossless
        d = sequence_drafts(base, head, prompt + answer, len(prompt), k, budget)
        link = st.links[0]
        assert walk_draft_starts(d.rows) == [a + 1 for a in link.accepted]  # round by round
        assert link.drafted[0] == 0 and st.prompt_shared  # the first token is the target's own
        chain_acc += [a + 1 for a, n in zip(link.accepted, link.drafted) if n]  # per draft
    rep = draft_start_acceptance(base, head, seqs, k=k, max_new_tokens=budget)
    assert rep["mean_accepted_length"] == sum(chain_acc) / len(chain_acc)
    assert rep["starts"] == len(chain_acc)
    assert rep["histogram"] == dict(sorted(Counter(chain_acc).items()))
    assert max(chain_acc) >= 3 and rep["base_agrees"] == 1.0


def test_draft_starts_with_eos_and_a_larger_budget():
    base, head = _world()
    cnt = Counter(t for p in _prompts(6, seed=1) for t in generate_tokens(base, p, 40))
    eos = {cnt.most_common(3)[2][0]}
    ended = 0
    for prompt in _prompts(8, seed=2):
        answer = list(generate_tokens(base, prompt, 40, eos=eos))
        ended += len(answer) < 40
        tl = ModelLevel(base, "target")
        out, st = Chain([tl, EagleLevel(head, tl)], k=5, eos=eos).generate(prompt, 40)
        assert out == answer
        d = sequence_drafts(base, head, prompt + answer, len(prompt), 5, max_new_tokens=40)
        assert walk_draft_starts(d.rows) == [a + 1 for a in st.links[0].accepted]
    assert ended >= 1


def test_all_positions_and_report_fields():
    base, head = _world()
    seqs = [(p + list(generate_tokens(base, p, 20)), len(p)) for p in _prompts(3)]
    both = diagnose(base, head, seqs, k=4, max_new_tokens=20)
    assert both["draft_start"] == draft_start_acceptance(base, head, seqs, k=4, max_new_tokens=20)
    alls = both["all"]
    assert alls == draft_start_acceptance(base, head, seqs, k=4, at="all", max_new_tokens=20)
    # every answer position with a draft: not the first (the target's own), not the last (no budget left)
    assert alls["starts"] == 54 and alls["sequences"] == 3
    assert sum(alls["histogram"].values()) == 54 and len(alls["depth_rate"]) == 4
    assert 0 <= alls["step1"] <= 1 and alls["draft_vocab_coverage"] is None
    with pytest.raises(ConfigError, match="at"):
        draft_start_acceptance(base, head, seqs, at="middle")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        draft_start_acceptance(base, head, seqs, max_new_tokens=5)


def test_reduced_draft_vocabulary_coverage():
    base, _ = _world()
    torch.manual_seed(1)
    head = EagleHead(DrafterConfig.for_base(base.args, draft_vocab_size=32)).bind(base).eval()
    seqs = [(p + list(generate_tokens(base, p, 20)), len(p)) for p in _prompts(3)]
    top = [t for t, _ in Counter(t for s, n in seqs for t in s[n:]).most_common(8)]  # part of the answers' tokens
    ids = torch.tensor(sorted(top + [i for i in range(128) if i not in top][:32 - len(top)]))
    head.set_draft_vocab(ids)
    rep = draft_start_acceptance(base, head, seqs, k=3, at="all", max_new_tokens=20)
    answer_tokens = [t for s, n in seqs for t in s[n + 1:-1]]  # the positions drafted from (see above)
    assert rep["draft_vocab_coverage"] == sum(t in set(ids.tolist()) for t in answer_tokens) / len(answer_tokens)
    tl = ModelLevel(base, "target")  # drafts map back through d2t exactly as EagleLevel's do
    for s, n in seqs:
        _, st = Chain([tl, EagleLevel(head, tl)], k=3).generate(s[:n], 20)
        head.drop_caches()
        d = sequence_drafts(base, head, s, n, 3, 20)
        assert walk_draft_starts(d.rows) == [a + 1 for a in st.links[0].accepted]


def test_command_line(tmp_path, capsys):
    tiny_hf_folder(tmp_path / "m", vocab=64, init_std=0.2)
    from polybasic.models import load_model

    lm = load_model(str(tmp_path / "m"))
    torch.manual_seed(0)
    save_head(tmp_path / "head.safetensors", EagleHead(DrafterConfig.for_base(lm.args)).bind(lm.model))
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"instruction": f"w{i} w{i + 1}", "input": "", "output": ""} for i in range(6)]))
    main(["--model", str(tmp_path / "m"), "--dtype", "float32,bfloat16", "--head", str(tmp_path / "head.safetensors"),
          "--data", str(data), "--prompts", "2", "--max-new-tokens", "8", "--k", "3", "--chain"])
    out = capsys.readouterr().out
    assert "records 4..5 of 6" in out  # the last records by default
    rows = [x.split() for x in out.splitlines() if x.split()[:1] in (["float32"], ["bfloat16"])]
    assert [r[:2] for r in rows] == [["float32", "draft_start"], ["float32", "all"],
                                     ["bfloat16", "draft_start"], ["bfloat16", "all"]]
    assert rows[0][4] == rows[0][-1]  # fp32: the diagnostic's tau is the real chain's
