"""Token trees: a level scores a drafted tree in one forward (models.tree), keeps the verified path
(runtime.tree_verify), and a chain with trees stays lossless: greedy output equals the target's greedy decoding
on 2, 3 and 4 levels, eager and compiled; sampled output follows the target's distribution (chi-square, first
token and 3-token sequences, T = 1 and T = 0.7 with top-p), and the tree rule itself samples exactly from p for
drafts made without replacement, while a wrong rule (accept every child) is rejected by the same test."""
import pytest
import torch

from polybasic.config import SamplingConfig
from polybasic.errors import ConfigError
from polybasic.models import bf16_rows
from polybasic.models import tree as trees
from polybasic.planner.measure import pair_acceptance
from polybasic.runtime import tree_verify
from polybasic.runtime.chain import Chain, scored_rows
from polybasic.runtime.chainspec import LevelSpec, parse_chain_spec
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.levels import ModelLevel, NGramLevel, path_with_siblings
from polybasic.runtime.stats import ChainStats, LinkStats
from tests.helpers import lean_from_hf, perturbed_copy, tiny_hf
from tests.runtime.test_chain_distribution import N, P_MIN, SAMPLINGS, V, exact_joint, make_world
from tests.runtime.test_compiled_chain import head_on
from tests.stat_utils import chain_sample_counts, chi_square_pvalue

TREE_PROMPT = [3, 7, 2, 3, 5, 3, 7, 9, 3]  # "3" continues three ways: the n-gram level drafts branches
KW = dict(vocab=96, hidden=128, layers=2, heads=4, kv_heads=2, init_std=0.2)  # head size 32: the bf16 row kernel runs
TREE = dict(parents=[-1, 0, 1, 0, -1, 4, 2], tokens=[5, 6, 7, 8, 9, 10, 11])  # two roots, branches at 0 and 1


def test_layout_of_a_path_is_the_ordinary_call():
    pos, anc = trees.layout([-1, 0, 1, 2], start=10)
    assert pos.tolist() == [10, 11, 12, 13]
    assert anc.tolist() == [[7, 8, 9, 10], [8, 9, 10, 11], [9, 10, 11, 12], [10, 11, 12, 13]]
    assert torch.equal(trees.visible(pos, anc, 16), torch.ones(16, 16, dtype=torch.bool).tril()[10:14])


@pytest.mark.parametrize("start", [0, 2, 10])
def test_path_layout_and_visible_match_their_definitions(start):
    """path_layout (closed form, for a path's call through a tree step) equals layout of the path, without sharing
    pos's tensor; visible equals its definition (the prefix below the window and the slots the map names, none for a
    position before the sequence) for a path and a tree near the sequence's start."""
    pos = torch.arange(start, start + 4)
    got, want = trees.path_layout(pos), trees.layout([-1, 0, 1, 2], start)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0] is not pos
    for parents in ([-1, 0, 1, 2], TREE["parents"]):
        p, anc = trees.layout(parents, start)
        s = torch.arange(start + len(parents) + 3)
        named = (anc[:, :, None] == s[None, None, :]).any(1)  # [M, S]; negative entries name no slot
        assert torch.equal(trees.visible(p, anc, len(s)), (s[None, :] < (p - anc.shape[1] + 1)[:, None]) | named)


def test_layout_of_a_tree():
    pos, anc = trees.layout(TREE["parents"], start=20, width=4)
    assert pos.tolist() == [20, 21, 22, 21, 20, 21, 23]
    assert anc[6].tolist() == [20, 21, 22, 26]  # node 6: 0 -> 1 -> 2 -> itself
    assert anc[3].tolist() == [18, 19, 20, 23]  # node 3: the prefix, 0, itself
    assert anc[5].tolist() == [18, 19, 24, 25]
    seen = trees.visible(pos, anc, 30)
    assert seen[5].nonzero().flatten().tolist() == list(range(20)) + [24, 25]
    assert trees.path_slots(TREE["parents"], 6, 20) == [20, 21, 22, 26]
    assert trees.pad([-1, -1], 4) == [-1, -1, 1, 2]
    with pytest.raises(ConfigError, match=r"parents\[1\]"):
        trees.depths([-1, 1])


def test_scored_rows_count_the_tree():
    assert scored_rows(4, None, 2, tree_width=3) == [13]
    assert scored_rows(4, [6], 3, tree_width=3) == [11, 13]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf("llama", seed=0, **KW)


KERNELS = [(torch.float32, None), (torch.bfloat16, "onednn"), (torch.bfloat16, "bf16_rows")]


@torch.inference_mode()
@pytest.mark.parametrize("dtype, kernel", KERNELS, ids=["fp32", "bf16-onednn", "bf16-rows"])
def test_a_tree_call_scores_every_path_as_a_path_call_does(hf, dtype, kernel):
    """After a prompt, each root-to-node path of a tree call gets the logits a call of that path alone gets
    (bit-equal in bf16, whose attention runs each row over its own keys: the row kernel through the tree's
    ancestor map, or one row at a time), and keep_path leaves the cache as that path's call would."""
    if kernel == "bf16_rows" and not bf16_rows.status()[0]:
        pytest.skip(f"the bf16_rows kernel cannot run here: {bf16_rows.status()[1]}")
    model = lean_from_hf(hf, dtype)
    if kernel:
        bf16_rows.bind(model, kernel)
    ctx = list(range(2, 14))
    model.setup_caches(64)
    model(torch.tensor([ctx]), 0)
    tree_logits = model(torch.tensor([TREE["tokens"]]), 12, parents=TREE["parents"])[0][0]  # [7, V]
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    for leaf in (2, 3, 5, 6):
        nodes = [s - 12 for s in trees.path_slots(TREE["parents"], leaf, 12)]
        ref, _ = model(torch.tensor([[TREE["tokens"][j] for j in nodes]]), 12)
        assert same(tree_logits[nodes], ref[0]), f"path to node {leaf}"
    level = ModelLevel(model)
    level.start(64)
    p = level.score(ctx, TREE["tokens"], SamplingConfig(), parents=TREE["parents"])  # [8, V]
    level.keep_path(ctx, TREE["tokens"], TREE["parents"], [4, 5])
    assert level.cached == ctx + [9, 10] and p.shape[0] == 8
    nxt = level.score(ctx + [9, 10, 3], [], SamplingConfig())  # reads the moved rows
    fresh = lean_from_hf(hf, dtype)
    if kernel:
        bf16_rows.bind(fresh, kernel)
    ref = ModelLevel(fresh)
    ref.start(64)
    ref.score(ctx, [9, 10], SamplingConfig())
    assert same(nxt, ref.score(ctx + [9, 10, 3], [], SamplingConfig()))


def _counts(rule, p, q, tokens, n, seed=0):
    """The next token's counts over n draws of `rule` at one node whose children are `tokens` drawn from q."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(n):
        path, nxt = rule(tokens, [-1] * len(tokens), q, p, False, g)
        counts[tokens[path[0]] if path else nxt] += 1
    return counts


def _without_replacement(q: torch.Tensor, r: int, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """r distinct tokens drawn one after another from q [V] without replacement, and the distribution each was
    drawn from [r, V]."""
    tokens, rows, left = [], [], q.clone()
    for _ in range(r):
        rows.append(left / left.sum())
        tokens.append(int(torch.multinomial(rows[-1], 1, generator=g)))
        left[tokens[-1]] = 0
    return tokens, torch.stack(rows)


def test_the_tree_rule_samples_exactly_from_the_verifier():
    """At one node with 3 children drafted without replacement, the emitted token follows p (chi-square over
    drafts and coins), and accepting every child would not."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(12, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(12, generator=g) * 1.5, -1)
    counts, wrong = torch.zeros(12), torch.zeros(12)
    for i in range(4000):
        tokens, rows = _without_replacement(q, 3, g)
        counts += _counts(tree_verify.verify_tree, p[None].expand(4, -1), rows, tokens, 1, seed=i)
        wrong[tokens[0]] += 1  # accept every child: the first child is always emitted
    assert chi_square_pvalue(counts, p) > P_MIN
    assert chi_square_pvalue(wrong, p) < P_MIN


def test_greedy_tree_rule_keeps_the_argmax_path():
    p = torch.zeros(8, 20)
    for row, tok in enumerate([5, 6, 0, 0, 9, 0, 0, 13]):  # after the context: 5; after node 0: 6 ...
        p[row, tok] = 1.0
    tokens = [5, 6, 7, 8, 9, 10, 11]  # node 1 (6) is node 0's child; node 6 (11) node 1's, not the argmax 13
    path, nxt = tree_verify.verify_tree(tokens, [-1, 0, 1, 0, -1, 4, 2], None, p, True)
    assert (path, nxt) == ([0, 1], 0)  # after node 1 the argmax is p[2]'s 0: no child has it


def build(models, names, k, width, thresholds=None, draft_confidence=0.0):
    """The target over `names` (top to bottom), the bottom one drafting trees `width` wide (an n-gram level's leaves,
    a model's candidates per depth, an EAGLE head's: 'eagle' drafts on the level above it)."""
    levels = [ModelLevel(models["target"], "target")]
    for i, n in enumerate(names):
        w = width if i == len(names) - 1 else 1
        if n == "ngram":
            levels.append(NGramLevel(max_ngram=2, tree_width=w))
        elif n == "eagle":
            levels.append(EagleLevel(head_on(levels[-1].model, "eagle1", seed=5), levels[-1], tree_width=w))
        else:
            levels.append(ModelLevel(models[n], n, tree_width=w))
    return Chain(levels, k=k, thresholds=thresholds or [k + 2] * (len(names) - 1), eos={1},
                 draft_confidence=draft_confidence)


CHAINS = {"n2": ["ngram"], "n3": ["close", "ngram"], "n4": ["close", "far", "ngram"],  # n-gram trees
          "m2": ["far"], "m3": ["close", "far"], "m4": ["close", "far", "farther"],  # a model's trees
          "e2": ["eagle"], "e3": ["close", "eagle"]}  # an EAGLE head's trees


def _models(hf, dtype=torch.float32):
    """The target and three copies, on the device's kernels (bf16: the row kernels where they run, as
    models.prepare binds them)."""
    return {"target": _lean(hf, dtype), "close": _lean(perturbed_copy(hf, 0.02, seed=1), dtype),
            "far": _lean(perturbed_copy(hf, 0.06, seed=2), dtype),
            "farther": _lean(perturbed_copy(hf, 0.2, seed=3), dtype)}


def _lean(hf, dtype):
    model = lean_from_hf(hf, dtype)
    bf16_rows.bind(model)
    return model


def _prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeats of varied continuations, so the n-gram level finds several matches (trees)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 12, (24,), generator=g).tolist() for _ in range(n)]


def _check_greedy(models, reference, names, compiled: bool):
    branched = False
    for k, width in ((3, 2), (4, 4)):
        chain = build(models, names, k, width)
        for prompt in _prompts(3, seed=k + width):
            ref = list(generate_tokens(reference, prompt, 40, eos={1}))
            out, stats = chain.generate(prompt, 40)
            assert out == ref, f"{names} k={k} width={width} {'compiled' if compiled else 'eager'}"
            branched |= max(stats.links[-1].drafted) > k  # some verification scored more nodes than a path
    assert branched, "no tree with branches was verified"


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_tree_chains_equal_the_target(hf, chain, dtype):
    models = _models(hf, dtype)
    _check_greedy(models, models["target"], CHAINS[chain], compiled=False)


@pytest.mark.parametrize("chain", ["n3", "m2", "e2", "e3"])
def test_a_draft_confidence_cuts_a_tree_s_path_and_keeps_greedy_identity(hf, chain):
    """draft_confidence ends the path of a model's or head's tree after a token the drafter was unsure of (siblings go
    there only), as it ends a path draft; an n-gram tree, which cannot tell, is drafted whole. Output: the
    target's."""
    models = _models(hf)
    k, chain_ = 4, build(models, CHAINS[chain], 4, 2, draft_confidence=0.6)
    bottom = chain_.levels[-1]
    cut, drafts = [0], [0]
    if not isinstance(bottom, NGramLevel):
        draft = bottom.draft

        def spy(context, k_, sampling, generator, eos, min_confidence=0.0):
            out = draft(context, k_, sampling, generator, eos, min_confidence)
            drafts[0] += 1
            cut[0] += min_confidence == 0.6 and len(out[0]) < k_ and out[0][-1] not in eos
            return out
        bottom.draft = spy
    for prompt in _prompts(3, seed=11):
        ref = list(generate_tokens(models["target"], prompt, 40, eos={1}))
        out, stats = chain_.generate(prompt, 40)
        assert out == ref, chain
        assert max(stats.links[-1].drafted) > 1
    if isinstance(bottom, NGramLevel):
        assert max(stats.links[-1].drafted) > k  # whole trees: more nodes than a path's k
    else:
        assert drafts[0] > 0 and cut[0] > 0, "no tree's path was cut"


@pytest.mark.parametrize("chain", ["n2", "n3", "m2", "e3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_greedy_tree_chains_equal_the_target(hf, chain, dtype):
    models = _models(hf, dtype)
    levels = build(models, CHAINS[chain], 4, 4).levels
    compile_levels(levels, 128, sizes=(1, 4, 8, 16))
    above = models[(["target"] + CHAINS[chain])[-2]]  # the level that verifies the trees
    warm = above._static.compiles
    _check_greedy(models, _lean(hf, dtype), CHAINS[chain], compiled=True)
    assert any(key[-1] for key in above._static.seen), "no compiled tree step ran"
    assert above._static.compiles == warm, "a tree step compiled after compile_levels warmed them"


@pytest.mark.parametrize("sname", list(SAMPLINGS))
@pytest.mark.parametrize("cname", ["n2", "n3", "m2", "m3", "m2-cut"])
def test_tree_chain_samples_match_target(cname, sname):
    """n-gram trees (one-hot candidates) and a model's trees (siblings drawn without replacement); m2-cut: the
    model's tree paths cut by a draft confidence."""
    hf, models = make_world("llama")
    names = {"n2": ["ngram"], "n3": ["mid", "ngram"], "m2": ["far"], "m3": ["mid", "far"], "m2-cut": ["far"]}[cname]
    levels = [ModelLevel(models["target"], "target")]
    levels += [NGramLevel(max_ngram=2, tree_width=3) if x == "ngram" else ModelLevel(models[x], x) for x in names]
    levels[-1].tree_width = 3
    chain = Chain(levels, k=3, thresholds=[2] * (len(names) - 1), share_prompt_kv=False,
                  draft_confidence=0.5 if cname.endswith("cut") else 0.0)
    branched = _count_branching(levels[-1])
    first, seqs = chain_sample_counts(chain, TREE_PROMPT, SAMPLINGS[sname], seed=99, n=N, vocab=V)
    p1, joint = exact_joint(hf, SAMPLINGS[sname], TREE_PROMPT)
    assert chi_square_pvalue(first, p1) > P_MIN
    assert chi_square_pvalue(seqs, joint) > P_MIN
    # most generations verified a tree with siblings; cut by a confidence, only those whose path ended unsure
    assert branched[0] > (N // 5 if cname.endswith("cut") else N // 2)


def _count_branching(ngram) -> list[int]:
    """[trees with siblings that the level `ngram` drafts from now on] (a counter its propose_tree updates)."""
    seen, propose = [0], ngram.propose_tree

    def counted(*args):
        tokens, parents, q = propose(*args)
        seen[0] += len(set(parents)) < len(parents)
        return tokens, parents, q
    ngram.propose_tree = counted
    return seen


@pytest.mark.parametrize("bottom", ["ngram", "model"])
def test_compiled_tree_chain_samples_match_target(device, bottom):
    """The compiled tree steps on every device (CUDA graphs on CUDA: gpu marker): an n-gram level's trees under a
    middle level, and a model's trees (siblings drawn without replacement) under the target."""
    hf, _ = make_world("llama")
    models = {"target": lean_from_hf(hf).to(device), "mid": lean_from_hf(perturbed_copy(hf, 0.3, seed=11)).to(device)}
    levels = [ModelLevel(models["target"], "target"), ModelLevel(models["mid"], "mid")]
    levels += [NGramLevel(max_ngram=2, tree_width=3)] if bottom == "ngram" else []
    levels[-1].tree_width = 3
    compile_levels(levels, 64, sizes=(1, 4, 8, 16))
    chain = Chain(levels, k=3, thresholds=[2] * (len(levels) - 2), share_prompt_kv=False)  # n-gram: a tree after "3"
    branched = _count_branching(levels[-1])
    sampling = SAMPLINGS["t0.7-p0.9"]
    first, seqs = chain_sample_counts(chain, TREE_PROMPT, sampling, seed=5, n=N, vocab=V)
    p1, joint = exact_joint(hf, sampling, TREE_PROMPT)
    assert chi_square_pvalue(first, p1) > P_MIN and chi_square_pvalue(seqs, joint) > P_MIN
    assert branched[0] > N // 2


def test_tree_widths_are_checked_and_spelled():
    with pytest.raises(ConfigError, match="tree_width"):
        NGramLevel(tree_width=0)
    spec = parse_chain_spec("target@bfloat16+ngram:2/4").levels
    assert spec[-1].tree_width == 4 and spec[-1].name == "ngram:2/4"
    assert LevelSpec.from_dict(spec[-1].to_dict()) == spec[-1]
    assert parse_chain_spec("ngram").levels[0].to_dict() == {"kind": "ngram", "max_ngram": 3, "tree_width": 1,
                                                              "name": "ngram"}
    with pytest.raises(ConfigError, match="tree width"):
        parse_chain_spec("ngram:3/x")


def test_model_tree_spelling_and_checks():
    spec = parse_chain_spec("runs/copy/model.safetensors@w4a8#3+ngram").levels
    assert spec[0].kind == "quantized" and spec[0].kernel == "w4a8" and spec[0].tree_width == 3
    assert spec[0].name == "runs/copy/model.safetensors@w4a8#3" and spec[1].tree_width == 1
    assert LevelSpec.from_dict(spec[0].to_dict()) == spec[0] and spec[0].to_dict()["tree_width"] == 3
    assert "tree_width" not in parse_chain_spec("target@bfloat16").levels[0].to_dict()
    assert parse_chain_spec("eagle:h.safetensors#2").levels[0].tree_width == 2
    assert LevelSpec("model", source="m", dtype="bfloat16", tree_width=2).name == "m@bfloat16#2"
    for bad, match in (("target@bfloat16#x", "after '#'"), ("ngram:3#2", "after '/'"),
                       ("#2", "after '#'")):
        with pytest.raises(ConfigError, match=match):
            parse_chain_spec(bad)
    with pytest.raises(ConfigError, match="tree_width"):
        LevelSpec("model", source="m", tree_width=0)


def test_only_the_bottom_level_drafts_trees(hf):
    models = _models(hf)
    with pytest.raises(ConfigError, match="only the bottom level drafts trees"):
        Chain([ModelLevel(models["target"]), ModelLevel(models["close"], "close", tree_width=2), NGramLevel()])


def test_path_with_siblings_greedy_ranks_by_logits():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -9.0], [5.0, 0.0, 4.0, 1.0, 0.0]])  # [2, V]
    q = torch.nn.functional.one_hot(torch.tensor([1, 0]), 5).float()
    tokens, parents, rows = path_with_siblings([1, 0], q, logits, 3, True, None)
    assert tokens == [1, 0, 2, 3, 2, 3] and parents == [-1, 0, -1, -1, 0, 0]
    assert torch.equal(rows.argmax(-1), torch.tensor(tokens)) and torch.equal(rows.sum(-1), torch.ones(6))
    assert path_with_siblings([1, 0], q, logits, 1, True, None)[0] == [1, 0]


def test_path_with_siblings_greedy_over_a_draft_vocabulary_picks_what_the_full_vocabulary_would():
    """Greedy siblings ranked over a reduced draft vocabulary's columns are the tokens the same probabilities spread
    over the target's vocabulary rank first (ties to the lower token id), their rows one-hot in the target's."""
    columns = torch.tensor([0, 2, 5, 7])  # the draft vocabulary's token ids in a vocabulary of 8
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 4.0, 1.2]])  # [2, 4]: a tie at depth 0
    path = [2, 0]  # each depth's argmax column, as target tokens
    q = torch.nn.functional.one_hot(torch.tensor(path), 8).float()
    tokens, parents, rows = path_with_siblings(path, q, logits, 3, True, None, columns)
    full = torch.zeros(2, 8).index_copy_(1, columns, torch.softmax(logits, -1))
    want = list(path)
    for d in range(2):
        left = full[d].clone()
        left[path[d]] = 0
        want += [int(i) for i in left.argsort(descending=True, stable=True)[:2]]
    assert tokens == want == [2, 0, 5, 7, 5, 7] and parents == [-1, 0, -1, -1, 0, 0]
    assert rows.shape == (6, 8) and torch.equal(rows.argmax(-1), torch.tensor(tokens))
    assert path_with_siblings(path, q, logits, 3, True, None, columns, min_confidence=0.5)[0] == [2, 0, 5, 7]


def test_path_with_siblings_under_a_confidence_go_where_the_drafter_was_unsure():
    """With min_confidence, siblings only at the depths whose token the drafter gave less (greedy: by the softmax of
    its logits; sampled: by q); without one, at every depth."""
    logits = torch.tensor([[0.0, 5.0, 2.0, 1.0, -9.0], [1.2, 1.0, 1.1, 0.0, 0.0]])  # sure of 1, unsure of 0
    q = torch.nn.functional.one_hot(torch.tensor([1, 0]), 5).float()
    tokens, parents, _ = path_with_siblings([1, 0], q, logits, 3, True, None, min_confidence=0.6)
    assert tokens == [1, 0, 2, 1] and parents == [-1, 0, 0, 0]
    assert path_with_siblings([1, 0], q, logits, 3, True, None)[0] == [1, 0, 2, 3, 2, 1]
    assert path_with_siblings([1, 0], q, logits, 3, True, None, min_confidence=0.01)[0] == [1, 0]  # sure of both
    qs = torch.tensor([[0.1, 0.7, 0.2, 0.0, 0.0], [0.5, 0.0, 0.3, 0.2, 0.0]])
    tokens, parents, rows = path_with_siblings([1, 0], qs, logits, 2, False, torch.Generator().manual_seed(0),
                                               min_confidence=0.6)
    assert tokens[:2] == [1, 0] and len(tokens) == 3 and parents[2] == 0 and tokens[2] in (2, 3)
    assert torch.allclose(rows[2], torch.tensor([0.0, 0.0, 0.6, 0.4, 0.0]))


def test_path_with_siblings_samples_without_replacement():
    """Each sibling is drawn from q less the tokens drawn before it at that depth, renormalized, and recorded with
    that distribution; no token outside q's support (a top-p cut) is drafted."""
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    g = torch.Generator().manual_seed(0)
    seen = torch.zeros(4)
    for _ in range(300):
        tokens, parents, rows = path_with_siblings([0], q, torch.zeros(1, 4), 4, False, g)
        assert tokens[0] == 0 and len(tokens) == 3 == len(set(tokens)) and parents == [-1, -1, -1]
        assert torch.allclose(rows[1], torch.tensor([0.0, 0.6, 0.4, 0.0]))
        assert rows[2][tokens[2]] == 1.0
        seen[tokens[1]] += 1
    assert seen[3] == 0 and 0.45 < seen[1] / 300 < 0.75  # drawn with probability 0.6


def test_ngram_trees_merge_shared_starts_best_first():
    ngram = NGramLevel(max_ngram=2, vocab_size=20)
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 7, 1, 2]
    assert ngram.lookup_many(ctx, 3, 4) == [[6, 7, 1], [3, 5, 9], [3, 4, 9]]
    tokens, parents, q = ngram.propose_tree(ctx, 3, 4, frozenset())
    assert tokens == [6, 7, 1, 3, 5, 9, 4, 9] and parents == [-1, 0, 1, -1, 3, 4, 3, 6]
    assert torch.equal(q.argmax(-1), torch.tensor(tokens)) and ngram.lookup(ctx, 3) == [6, 7, 1]


def test_probs_rows_handed_up_are_the_kept_path(hf):
    """A middle level verifying a tree hands up its own distributions at the kept tokens' positions."""
    models = _models(hf)
    chain = build(models, ["close", "ngram"], 3, 3)
    mid = chain.levels[1]
    prompt = _prompts(1, seed=3)[0]
    chain._k, chain.sampling, chain.generator = 3, SamplingConfig(), None
    for lvl in chain.levels:
        lvl.start(128)
    chain.stats = ChainStats()
    chain.stats.links = [LinkStats("a", "b"), LinkStats("b", "c")]
    new, p = next(chain._rounds(1, prompt, 20))
    ref = ModelLevel(lean_from_hf(perturbed_copy(hf, 0.02, seed=1)))
    ref.start(128)
    assert torch.allclose(p, ref.score(prompt, new[:-1], SamplingConfig()), atol=1e-5)


def test_rank_trials_and_the_profile_of_a_tree_pair(hf):
    parents = TREE["parents"]  # the context's children: 0, 4; node 0's: 1, 3; node 1's: 2
    assert tree_verify.rank_trials(parents, [0, 3]) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert tree_verify.rank_trials(parents, []) == [(0, 0, False), (0, 1, False)]
    models = _models(hf)
    pair = pair_acceptance(ModelLevel(models["target"], "target"), NGramLevel(max_ngram=2, tree_width=3, name="ng/3"),
                           _prompts(2, seed=1), k=3, max_new_tokens=24, eos={1})
    assert pair.tree_width == 3 and pair.nodes > 0
    assert pair.by_rank["0:0"][1] >= pair.by_rank.get("0:1", [0, 0])[1] > 0  # some trees branched; rank 1 is
    # tried only after rank 0
    assert sum(pair.histogram.values()) == pair.verifications
