"""Chains whose every level runs compiled static-shape steps (models.static) stay lossless: greedy output
equals the target's own greedy decoding, sampled output follows the target's distribution (chi-square),
for dense, quantized (int4pack, int8mm, w4a8) and EAGLE-head levels, with rejections, and so rollbacks, at
every depth. The step sizes are kept small (1, 4, 8) so that prompts run in padded chunks too."""
import copy
import warnings

import pytest
import torch

from polybasic.config import QuantConfig, SamplingConfig
from polybasic.models.eagle_head import DrafterConfig, make_head, save_head
from polybasic.models.loader import LoadedModel
from polybasic.quant.api import quantize_, quantized_modules
from polybasic.runtime.chain import Chain
from polybasic.runtime.chain_builder import parse_chain
from polybasic.runtime.compiled import compile_levels
from polybasic.runtime.eagle_level import EagleLevel
from polybasic.runtime.generate import generate_tokens
from polybasic.runtime.levels import ModelLevel, NGramLevel
from tests.helpers import lean_from_hf, perturbed_copy, tiny_hf_llama
from tests.runtime.test_chain_distribution import KW as DKW
from tests.runtime.test_chain_distribution import P_MIN, PROMPT, N, V, exact_joint
from tests.stat_utils import chain_sample_counts, chi_square_pvalue

SIZES = (1, 4, 8)  # as the suite's default (conftest), named here since the tests rely on it
KW = dict(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.2)
MAX_LEN = 128


def head_on(model, arch: str, seed: int):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_base(model.args, arch=arch, **({"feature_layers": (0,)} if arch == "eagle3" else {}))
    head = make_head(cfg).bind(model)
    with torch.no_grad():  # a head that sometimes agrees with its base: random but not silent
        for p in head.parameters():
            p.normal_(0.0, 0.05)
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_llama(seed=0, **KW)


def level_models(hf):
    """Fresh levels (compiling changes a model for good): the target, two dense copies, two quantized."""
    target, close, far = lean_from_hf(hf), lean_from_hf(perturbed_copy(hf, 0.02, 1)), lean_from_hf(perturbed_copy(hf, 0.06, 2))
    q4 = quantize_(lean_from_hf(perturbed_copy(hf, 0.02, 1), torch.bfloat16),
                   QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack"))
    q8 = quantize_(lean_from_hf(hf), QuantConfig(w_bits=8, a_bits=8, group_size=-1, kernel="int8mm"))
    return {"target": target, "close": close, "far": far, "q4": q4, "q8": q8, "qa8": w4a8_copy(hf)}


def w4a8_copy(hf):
    """A perturbed bf16 copy in the CPU kernel 'w4a8' (torch's int4 kernel where it cannot run, with a warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_(lean_from_hf(perturbed_copy(hf, 0.02, 1), torch.bfloat16),
                         QuantConfig(w_bits=4, group_size=32, kernel="w4a8"))


def build_levels(models, names):
    levels = [ModelLevel(models["target"], "target")]
    for n in names:
        if n == "ngram":
            levels.append(NGramLevel(max_ngram=2))
        elif n.startswith("eagle"):
            arch, _, on = n.partition("@")
            base = next(lv for lv in levels if lv.name == on)
            levels.append(EagleLevel(head_on(base.model, arch, seed=len(levels)), base, name=n))
        else:
            levels.append(ModelLevel(models[n], n))
    return levels


CHAINS = {  # names below the target, top to bottom
    "dense-4": ["close", "far", "ngram"],
    "int4pack-3": ["q4", "ngram"],
    "w4a8-3": ["qa8", "ngram"],
    "int8mm-dense-3": ["q8", "far"],
    "eagle1-on-middle": ["close", "eagle1@close"],
    "eagle3-on-target": ["eagle3@target"],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_compiled_greedy_chain_equals_target(hf, name):
    models = level_models(hf)
    eager_target = lean_from_hf(hf)
    levels = build_levels(models, CHAINS[name])
    assert compile_levels(levels, MAX_LEN, sizes=SIZES) > 0
    target = models["target"]
    chain = Chain(levels, k=3, thresholds=[5] * (len(levels) - 2), eos={1})
    g = torch.Generator().manual_seed(7)
    rejected = [False] * (len(levels) - 1)  # per link: a verification that rejected part of its draft
    for trial in range(3):
        prompt = torch.randint(2, 96, (14,), generator=g).tolist()
        prompt += prompt[:5]  # 19 tokens: padded chunks of 8; a repeat for the n-gram level
        ref = list(generate_tokens(target, prompt, 40, eos={1}))
        assert ref == list(generate_tokens(eager_target, prompt, 40, eos={1})), "compiled vanilla drifted"
        out, stats = chain.generate(prompt, 40)
        assert out == ref, f"{name} trial {trial}"
        for i, ln in enumerate(stats.links):
            rejected[i] |= any(a < d for a, d in zip(ln.accepted, ln.drafted))
    assert all(rejected), f"links without a rejection (no rollback exercised): {rejected}"
    steps = [lv.model._static for lv in levels if isinstance(lv, ModelLevel)]
    steps += [lv.head._static for lv in levels if isinstance(lv, EagleLevel)]
    assert all(s is not None and s.calls > s.compiles for s in steps)  # every model level ran compiled steps


def test_compiled_dense_chain_on_every_device(hf, device):
    """The same compiled steps on every device: on CUDA they are captured as CUDA graphs (gpu marker)."""
    target, close = lean_from_hf(hf).to(device), lean_from_hf(perturbed_copy(hf, 0.02, 1)).to(device)
    eager = lean_from_hf(hf).to(device)
    levels = [ModelLevel(target, "target"), ModelLevel(close, "close"), NGramLevel(max_ngram=2)]
    compile_levels(levels, MAX_LEN, sizes=SIZES)
    chain = Chain(levels, k=3, thresholds=[5], eos={1})
    prompt = list(range(2, 21)) + list(range(2, 8))
    ref = list(generate_tokens(eager, prompt, 40, eos={1}))
    for ahead in (False, True):  # the next step queued before the host reads a token, or after
        assert list(generate_tokens(target, prompt, 40, eos={1}, lookahead=ahead)) == ref
    assert chain.generate(prompt, 40)[0] == ref


def test_compiled_eagle_chain_on_every_device(hf, device):
    """An EAGLE head on a compiled target, on every device: greedy identity with rejections, no compile
    after warm-up, and on CUDA every step a CUDA graph (inductor skipped none)."""
    from torch._dynamo.utils import counters

    models = {"target": lean_from_hf(hf).to(device)}
    levels = build_levels(models, ["eagle3@target"])
    levels[1].head.to(device)
    eager = lean_from_hf(hf).to(device)
    skips = counters["inductor"]["cudagraph_skips"]  # inductor decides at compile time
    compile_levels(levels, MAX_LEN, sizes=SIZES)
    chain = Chain(levels, k=3, eos={1})
    before = counters["frames"]["ok"]
    g = torch.Generator().manual_seed(3)
    rejected = False
    for n in (11, 19):
        prompt = torch.randint(2, 96, (n,), generator=g).tolist()
        ref = list(generate_tokens(eager, prompt, 30, eos={1}))
        out, stats = chain.generate(prompt, 30)
        assert out == ref
        rejected |= any(a < d for a, d in zip(stats.links[0].accepted, stats.links[0].drafted))
    assert rejected, "no rejection: rollback not exercised"
    assert counters["frames"]["ok"] == before, "a step compiled after warm-up"
    assert counters["inductor"]["cudagraph_skips"] == skips, "inductor ran a step without a CUDA graph"


def test_warm_steps_leave_nothing_to_compile(hf):
    """After compile_levels, requests of any prompt length (chunks sliced from it, padded rows) and any
    draft length run without a new compile: the first request after start-up is not a compile."""
    from torch._dynamo.utils import counters

    models = level_models(hf)
    levels = build_levels(models, ["close", "eagle3@close"])
    compile_levels(levels, MAX_LEN, sizes=SIZES)
    chain = Chain(levels, k=3, thresholds=[5], eos={1})
    before = counters["frames"]["ok"]
    for n in (9, 17, 23, 40):  # longer than the largest size: slices of the prompt, each its own strides
        prompt = [2 + (7 * i) % 90 for i in range(n)]
        list(generate_tokens(models["target"], prompt, 12, eos={1}))
        chain.generate(prompt, 12)
    assert counters["frames"]["ok"] == before


def test_compiled_steps_match_eager_at_every_size_and_rollback(hf):
    """Logits and features of compiled steps equal eager ones (to float rounding) for every token count,
    padded or chunked, including calls that roll back to an earlier position."""
    eager, comp = lean_from_hf(hf), lean_from_hf(hf)
    compile_levels([ModelLevel(comp)], MAX_LEN, sizes=SIZES)
    eager.setup_caches(MAX_LEN)
    ids = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for start, m in [(0, 19), (19, 1), (20, 3), (23, 8), (21, 2), (23, 1), (24, 9), (10, 30)]:
            a, ha = eager(ids[:, start:start + m], start)
            b, hb = comp(ids[:, start:start + m], start)
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)  # fused kernels sum in another order
            torch.testing.assert_close(hb, ha, rtol=1e-4, atol=1e-4)
            a1, _ = eager(ids[:, start:start + m], start, last_only=True)
            b1, _ = comp(ids[:, start:start + m], start, last_only=True)
            torch.testing.assert_close(b1, a1, rtol=1e-4, atol=1e-4)


SAMPLED = {"dense-3": ["mid", "small"], "eagle1": ["eagle1@target"], "w4a8-2": ["qa8"]}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_compiled_sampled_chain_matches_target(name):
    hf = tiny_hf_llama(seed=10, **DKW)
    models = {"target": lean_from_hf(hf), "mid": lean_from_hf(perturbed_copy(hf, 0.3, seed=11)),
              "small": lean_from_hf(tiny_hf_llama(seed=13, **{**DKW, "hidden": 16})), "qa8": w4a8_copy(hf)}
    levels = build_levels(models, SAMPLED[name])
    compile_levels(levels, 64, sizes=SIZES)
    sampling = SamplingConfig(temperature=1.0)
    p1, joint = exact_joint(hf, sampling)
    chain = Chain(levels, k=3, thresholds=[2] * (len(levels) - 2))
    first, seqs = chain_sample_counts(chain, PROMPT, sampling, 4321, N, V)
    assert chi_square_pvalue(first, p1) > P_MIN
    assert chi_square_pvalue(seqs, joint) > P_MIN


def test_a_copy_of_a_compiled_model_is_eager(hf):
    """A deep copy (the bench copies the target per method) runs its own weights, eagerly: the compiled
    steps stay bound to the original."""
    model = lean_from_hf(hf)
    compile_levels([ModelLevel(model)], MAX_LEN, sizes=SIZES)
    twin = copy.deepcopy(model)
    assert twin._static is None and model._static is not None
    with torch.no_grad():
        twin.output.weight.mul_(-1.0)  # tied: the embedding too
    prompt = list(range(2, 20))
    assert list(generate_tokens(twin, prompt, 8)) != list(generate_tokens(model, prompt, 8))


def test_caches_take_each_requests_size_class_and_compile_levels_warms_them():
    """Static caches shrink as well as grow to a request's size class (a step reads every cache row);
    compile_levels(lengths=) compiles every class a run needs before its first request, so requests of
    both classes then compile nothing, and the chain stays the target's greedy output in each."""
    hf = tiny_hf_llama(seed=0, max_pos=1024, **KW)
    models = {"target": lean_from_hf(hf), "close": lean_from_hf(perturbed_copy(hf, 0.02, 1))}
    levels = build_levels(models, ["close"])
    compile_levels(levels, 300, sizes=SIZES, lengths=[40, 290])  # classes of 256 and 512 rows
    comp = models["close"]
    steps = comp._static
    assert comp.max_seq_len == 512 and steps.compiles > 0
    compiles = steps.compiles
    from torch._dynamo.utils import counters

    frames = counters["frames"]["ok"]
    chain = Chain(levels, k=3, eos={1})
    for n, rows in [(20, 256), (270, 512), (20, 256)]:
        prompt = [2 + (5 * i) % 90 for i in range(n)]
        out, _ = chain.generate(prompt, 12)
        assert comp.max_seq_len == rows and comp.layers[0].attention.kv_cache.k.shape[-2] == rows + max(SIZES)
        assert out == list(generate_tokens(models["target"], prompt, 12, eos={1}))
    assert steps.compiles == compiles  # every class was warmed before the first request
    assert counters["frames"]["ok"] == frames  # and dynamo recompiled nothing on a class switch


def test_seen_steps_skip_their_guards_and_stay_exact(hf):
    """Once a step's guards have passed for its key, its later calls run the compiled code without them
    (models.static.unguarded): the same outputs as the guarded calls and as eager ones, at every size and
    after rollbacks; in another grad mode a call is guarded again."""
    eager, comp = lean_from_hf(hf), lean_from_hf(hf)
    compile_levels([ModelLevel(comp)], MAX_LEN, sizes=SIZES)
    eager.setup_caches(MAX_LEN)
    steps = comp._static
    ids = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(4))
    calls = [(0, 19), (19, 1), (20, 3), (23, 8), (21, 2), (23, 1), (24, 4)]

    def run():
        with torch.inference_mode():
            for start, m in calls:
                a, ha = eager(ids[:, start:start + m], start)
                b, hb = comp(ids[:, start:start + m], start)
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(hb, ha, rtol=1e-4, atol=1e-4)
                yield b

    guarded = list(run())
    assert any(f is not None for f in steps.direct.values()), "no step found its compiled code"
    # from here on, a guarded call would fail: the CPU's steps call compiled regions (a layer), CUDA's the whole step
    compiled = steps.compiled, steps.fn
    if steps.regions:
        steps.compiled = dict.fromkeys(steps.compiled)
    else:
        steps.fn = None
    assert all(torch.equal(x, y) for x, y in zip(run(), guarded))
    assert all(torch.equal(x, y) for x, y in zip(run(), guarded))  # by now called straight (GraphCall)
    assert any(f is not None for f in steps.straight.values()), "no step was called straight"
    with torch.no_grad(), pytest.raises(TypeError):  # another grad mode: guarded again (here: no step)
        comp(ids[:, 20:21], 20)
    steps.compiled, steps.fn = compiled


def test_straight_calls_decode_exactly_and_are_dropped_with_the_caches():
    """Steps called straight (models.static.GraphCall: inductor's code on the tensors its wrappers gave it) write
    the KV cache as the wrapped calls do: greedy decoding at new positions equals eager decoding's, also after the
    caches are reallocated for another size class (which drops the straight calls that held the old caches)."""
    hf = tiny_hf_llama(seed=0, max_pos=1024, **KW)
    eager, comp = lean_from_hf(hf), lean_from_hf(hf)
    compile_levels([ModelLevel(comp)], 300, sizes=SIZES, lengths=[40, 290])
    steps = comp._static
    for n in (20, 270, 20):  # 256-, 512-, then 256-row caches again
        prompt = [2 + (7 * i) % 90 for i in range(n)]
        assert list(generate_tokens(comp, prompt, 16)) == list(generate_tokens(eager, prompt, 16))
        assert any(f is not None for f in steps.straight.values()), "no step was called straight"
        caches = {id(layer.attention.kv_cache.k) for layer in comp.layers}
        held = {id(t) for f in steps.straight.values() if f is not None for t in f.template if t is not None}
        assert caches <= held  # the straight calls hold today's caches, not the ones reallocated before them


def test_a_graph_call_is_made_only_from_calls_that_show_it_safe():
    """GraphCall.of takes two records (graph, its inputs, its outputs, the call's args, the call's output): an
    input neither one of the call's own tensors nor shared by both calls, or outputs other than the call's, refuse."""
    from polybasic.models.static import GraphCall

    class Graph:
        def current_callable(self, inputs):
            x, w = inputs
            return [x * w]
    g, w = Graph(), torch.tensor([2.0])
    a1, a2 = torch.tensor([1.0]), torch.tensor([3.0])
    o1, o2 = a1 * w, a2 * w
    call = GraphCall.of((g, [a1, w], [o1], (None, a1), o1), (g, [a2, w], [o2], (None, a2), o2))
    assert call is not None and torch.equal(call((None, torch.tensor([5.0]))), torch.tensor([10.0]))
    assert call.template[0] is None and call.template[1] is w  # it holds no call's own tensor
    copy2 = a2.clone()  # a wrapper fed the graph a copy of the argument: not its own tensor, not shared
    assert GraphCall.of((g, [a1, w], [o1], (None, a1), o1), (g, [copy2, w], [o2], (None, a2), o2)) is None
    assert GraphCall.of((g, [a1, w], [o1], (None, a1), o1), (g, [a2, w.clone()], [o2], (None, a2), o2)) is None
    assert GraphCall.of((g, [a1, w], [o1], (None, a1), o1), (g, [a2, w], [o2, w], (None, a2), o2)) is None
    assert GraphCall.of((g, [a1, w], [o1], (None, a1), o1), (g, [a2, w], [o2.clone()], (None, a2), o2)) is None
    assert GraphCall.of((g, [a1, w], [o1], (None, a1), o1), (Graph(), [a2, w], [o2], (None, a2), o2)) is None


@pytest.mark.parametrize("kernel", ["w4a8", "int4pack"])
def test_a_head_on_4_bit_weights_drafts_losslessly(hf, tmp_path, kernel):
    """'eagle:PATH@KERNEL': the head's fc, decoder block and draft rows rounded to 4 bits at load;
    the chain, eager and compiled, still emits the target's greedy decoding."""
    target = lean_from_hf(hf)
    path = tmp_path / "head.safetensors"
    save_head(path, head_on(target, "eagle1", seed=5))
    eager = lean_from_hf(hf)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (11, 19)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # w4a8 where VNNI is missing: torch's int4 kernel, with a warning
        for compiled in (False, True):
            levels = parse_chain(f"eagle:{path}@{kernel}", LoadedModel(target, None, target.args, "tiny", tmp_path))
            blocks = {n for n, m in levels[1].head.named_modules() if n.startswith("layers.") and hasattr(m, "kernel")}
            assert set(quantized_modules(levels[1].head)) == {"fc"} | blocks
            assert levels[1].head.fc.kernel in (kernel, "int4pack") and len(quantized_modules(levels[1].head)) > 1
            h = torch.randn(2, target.args.dim)
            dense = torch.nn.functional.linear(target.norm(h), target.output.weight)  # the rows as trained
            assert levels[1].head._rows[1].kernel in (kernel, "int4pack")  # w4a8 without VNNI: torch's int4 kernel
            got = levels[1].head.logits(h)
            assert not torch.equal(got, dense) and (got - dense).abs().max() < 0.1 * dense.abs().max()  # 4-bit rows
            if compiled:
                compile_levels(levels, MAX_LEN, sizes=SIZES)
            chain = Chain(levels, k=3, eos={1})
            for prompt in prompts:
                assert chain.generate(prompt, 30)[0] == list(generate_tokens(eager, prompt, 30, eos={1})), compiled


def test_a_later_compile_reports_to_its_own_caller(hf):
    """Steps compiled for one caller (a bench method) and compiled further for another: the later compiles are
    reported to the later caller's progress line, not the first's."""
    model = lean_from_hf(hf)
    first, second = [], []
    model.compile_steps(sizes=(1, 2), notify=first.append)
    model.setup_caches(MAX_LEN)
    model.warm_steps(decode=True)  # the one-token and prefill-chunk steps
    assert first
    seen = len(first)
    model.compile_steps(sizes=(1, 2), notify=second.append)
    model.warm_steps()  # each size's all-rows step: new compiles
    assert len(first) == seen and second


def test_a_compiled_head_step_never_copies_fcs_weight(hf):
    """An eagle3 head's compiled step over 2+ rows of the base's features multiplies them by fc's weight as it is:
    a strided slice of them made the compiled matmul copy the weight at every call (14 MB a call on
    Qwen2.5-Coder-1.5B)."""
    from torch.profiler import ProfilerActivity, profile

    models = {"target": lean_from_hf(hf, torch.bfloat16)}  # bf16, as a head runs on a CPU
    levels = build_levels(models, ["eagle3@target"])
    levels[1].head.to(torch.bfloat16)
    compile_levels(levels, MAX_LEN, sizes=SIZES)
    head = levels[1].head
    wide = head.cfg.dim * (1 + len(head.cfg.feature_layers))
    tokens, feats = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, wide, dtype=torch.bfloat16)
    with torch.inference_mode():
        head(tokens, feats, 10)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            head(tokens, feats, 10)
    n = head.fc.weight.numel()
    copies = [e for e in prof.events() if e.name in ("aten::clone", "aten::copy_", "aten::contiguous")
              and any(len(s) and int(torch.tensor(s).prod()) == n for s in e.input_shapes)]
    assert not copies, [(e.name, e.input_shapes) for e in copies]
