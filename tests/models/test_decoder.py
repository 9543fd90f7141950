"""The lean decoder against transformers' LlamaForCausalLM and Qwen2ForCausalLM (q/k/v biases,
rope theta 1e6) in fp32, tied and untied."""
from copy import deepcopy

import pytest
import torch

from polybasic.errors import ConfigError
from polybasic.models import ModelArgs
from polybasic.models.blocks import apply_rope
from polybasic.models.decoder import use_decode_layout
from polybasic.models.families import args_from_hf_config
from polybasic.models.prepare import compile_for_device
from tests.helpers import TINY_HF, lean_from_hf, tiny_hf, tiny_hf_llama


@pytest.fixture(params=[(f, t) for f in TINY_HF for t in (True, False)],
                ids=[f"{f}-{t}" for f in TINY_HF for t in ("tied", "untied")])
def pair(request):
    family, tie = request.param
    hf = tiny_hf(family, tie=tie)
    return hf, lean_from_hf(hf)


def ref_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("layout", ["plain", "decode"])
def test_prefill_decode_verify_match_transformers(pair, layout):
    hf, lean = pair
    if layout == "decode":
        use_decode_layout(lean)
    lean.setup_caches(64)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = ref_logits(hf, ids)
    with torch.inference_mode():
        prefill, hidden = lean(ids[:, :10], 0)
        one, _ = lean(ids[:, 10:11], 10)
        k, _ = lean(ids[:, 11:16], 11)
    torch.testing.assert_close(prefill, ref[:, :10])
    torch.testing.assert_close(one, ref[:, 10:11])
    torch.testing.assert_close(k, ref[:, 11:16])
    assert hidden.shape == (1, 10, hf.config.hidden_size)


def test_hidden_states_are_pre_norm_last_layer(pair):
    hf, lean = pair
    lean.setup_caches(32)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    # transformers' last entry is after the final norm; the one before the norm is what the last
    # layer produced, so compare via our own norm.
    with torch.inference_mode():
        _, hidden = lean(ids, 0)
    torch.testing.assert_close(lean.norm(hidden), out.hidden_states[-1])


def test_rollback_then_redecode(pair):
    hf, lean = pair
    lean.setup_caches(64)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (1, 20), generator=g)
    with torch.inference_mode():
        lean(ids[:, :12], 0)
        lean(ids[:, 12:18], 12)  # a draft of 6 tokens of which only 2 are accepted
        alt = ids.clone()
        alt[0, 14:] = torch.randint(0, 128, (6,), generator=g)
        redo, _ = lean(alt[:, 14:20], 14)  # rolled back to length 14
        step, _ = lean(torch.tensor([[7]]), 20)
    full = torch.cat([alt, torch.tensor([[7]])], dim=1)
    ref = ref_logits(hf, full)
    torch.testing.assert_close(redo, ref[:, 14:20])
    torch.testing.assert_close(step, ref[:, 20:21])


def test_last_only_equals_last_row(pair):
    _, lean = pair
    lean.setup_caches(32)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        full, _ = lean(ids, 0)
        last, _ = lean(ids, 0, last_only=True)
    torch.testing.assert_close(last, full[:, -1:])


@pytest.mark.parametrize("family", list(TINY_HF))
def test_bf16_close_to_fp32(family):
    hf = tiny_hf(family)
    a, b = lean_from_hf(hf), lean_from_hf(hf, torch.bfloat16)
    a.setup_caches(32)
    b.setup_caches(32)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        la, _ = a(ids, 0)
        lb, _ = b(ids, 0)
    assert lb.dtype == torch.bfloat16
    torch.testing.assert_close(lb.float(), la, atol=0.05, rtol=0.05)


def test_cache_bounds_are_checked():
    lean = lean_from_hf(tiny_hf_llama(max_pos=64))
    with pytest.raises(ConfigError, match="context window"):
        lean.setup_caches(65)
    lean.setup_caches(16)
    with pytest.raises(ConfigError, match="exceed the cache"):
        lean(torch.zeros(1, 17, dtype=torch.long), 0)


def test_model_args_validation():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=3, n_kv_heads=2, head_dim=4,
                  intermediate_size=8)
    with pytest.raises(ConfigError, match="unknown fields"):
        ModelArgs.from_dict({"vocab_size": 8, "bogus": 1})
    with pytest.raises(ConfigError, match="ModelArgs.family.*unknown family 'gpt2'.*llama, qwen2"):
        ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4,
                  intermediate_size=8, family="gpt2")


def test_family_configs_refuse_what_the_block_lacks():
    from transformers import LlamaConfig, Qwen2Config

    with pytest.raises(ConfigError, match="use_sliding_window"):
        args_from_hf_config(Qwen2Config(use_sliding_window=True, max_window_layers=0))
    with pytest.raises(ConfigError, match="attention_bias"):
        args_from_hf_config(LlamaConfig(attention_bias=True))
    with pytest.raises(ConfigError, match="hidden_act: 'gelu'"):
        args_from_hf_config(Qwen2Config(hidden_act="gelu"))
    with pytest.raises(ConfigError, match="model_type: 'gpt2' is not supported.*supported: llama, qwen2"):
        from types import SimpleNamespace

        args_from_hf_config(SimpleNamespace(model_type="gpt2"))
    args = args_from_hf_config(tiny_hf("qwen2", tie=False).config)
    assert (args.family, args.qkv_bias, args.rope_theta, args.tie_embeddings) == ("qwen2", True, 1e6, False)


def test_decode_layout_keeps_ties_and_logits(pair):
    _, lean = pair
    lean.setup_caches(32)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        ref, _ = lean(ids, 0)
        use_decode_layout(lean)
        out, _ = lean(ids, 0)
    assert not lean.output.weight.is_contiguous()
    assert (lean.output.weight is lean.tok_embeddings.weight) == lean.args.tie_embeddings
    torch.testing.assert_close(out, ref)


def test_apply_rope_sign_folded_matches_rotate_half():
    x = torch.randn(2, 3, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    rotated = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), x * cos + rotated * sin)


def test_decode_layout_makes_a_bf16_copy_of_a_transposed_model_contiguous(pair):
    _, lean = pair
    use_decode_layout(lean)
    copy = deepcopy(lean).to(torch.bfloat16)
    assert not copy.layers[0].attention.wqkv.weight.is_contiguous()  # .to keeps the fp32 strides
    use_decode_layout(copy)
    assert all(m.weight.is_contiguous() for m in copy.modules() if isinstance(m, torch.nn.Linear))
    assert (copy.output.weight is copy.tok_embeddings.weight) == copy.args.tie_embeddings


def test_compiled_decode_matches_transformers_and_eager_greedy():
    """Compiled static-shape steps (positions as data, so start varies without a new graph) give
    transformers' logits and the same greedy tokens as the eager decoder; compiled models round cache
    sizes up to few buckets."""
    from polybasic.runtime.generate import generate_tokens

    hf = tiny_hf_llama(tie=True)
    lean, compiled = lean_from_hf(hf), lean_from_hf(hf)
    compile_for_device(compiled)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    ref = ref_logits(hf, ids)
    compiled.setup_caches(40)
    assert compiled.max_seq_len == min(256, hf.config.max_position_embeddings)
    with torch.inference_mode():
        compiled(ids[:, :20], 0)
        steps = [compiled(ids[:, i:i + 1], i)[0] for i in range(20, 30)]  # start varies every call
    torch.testing.assert_close(torch.cat(steps, dim=1), ref[:, 20:30])
    assert compiled._static.calls >= 11  # the prefill's chunks and the steps went through the compiled steps
    for n_prompt in (7, 25):
        prompt = ids[0, :n_prompt].tolist()
        assert list(generate_tokens(compiled, prompt, 16)) == list(generate_tokens(lean, prompt, 16))


def test_the_args_name_every_family():
    from polybasic.models.args import FAMILY_NAMES
    from polybasic.models.families import FAMILIES

    assert tuple(FAMILIES) == FAMILY_NAMES


def test_plain_decoding_needs_only_the_decode_sizes():
    """decode_sizes keeps the one-token step and the prefill chunk; a model compiled with just those and
    warmed generates prompts of any length (short, one chunk, several) without another compile, and as
    the eager decoder does."""
    from polybasic.models.static import STEP_SIZES, decode_sizes
    from polybasic.runtime.generate import generate_tokens

    cpu = torch.device("cpu")
    assert decode_sizes([1, 2, 4, 64], cpu) == (1, 64) and decode_sizes([1], cpu) == (1,)
    assert decode_sizes(None, cpu) == (1, max(STEP_SIZES))
    with pytest.raises(ConfigError, match="must include 1"):
        decode_sizes([2, 64], cpu)
    hf = tiny_hf_llama(tie=True)
    lean, compiled = lean_from_hf(hf), lean_from_hf(hf)
    compile_for_device(compiled, sizes=decode_sizes([1, 2, 4, 16], cpu))
    compiled.setup_caches(120)
    compiled.warm_steps(decode=True)
    warm = compiled._static.compiles
    assert warm == 2  # the one-token step and the prefill chunk, each reading one row's logits
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    for n_prompt in (1, 3, 16, 37):
        prompt = ids[:n_prompt]
        assert list(generate_tokens(compiled, prompt, 12)) == list(generate_tokens(lean, prompt, 12))
    assert compiled._static.compiles == warm, "plain decoding ran a step size decode_sizes left out"


def test_covering_adds_the_rows_only_the_prefill_chunk_would_hold():
    """A chain's largest verification gets its own step size where it would otherwise run padded to the chunk;
    rows a smaller size holds add nothing (each size costs a compile)."""
    from polybasic.models.static import STEP_SIZES, covering

    cpu = torch.device("cpu")
    assert covering([1, 2, 4, 64], [6, 2], cpu) == (1, 2, 4, 6, 64)
    assert covering([1, 2, 4, 6, 9, 64], [10, 2], cpu) == (1, 2, 4, 6, 9, 10, 64)  # 10 rows: not padded to 64
    assert covering(None, [14, 2], cpu) == tuple(sorted(STEP_SIZES))  # 14 pads to 16, a size already
    assert covering([1, 64], [64, 80], cpu) == (1, 64)  # at or past the chunk: prefill-sized calls
    with pytest.raises(ConfigError, match="must include 1"):
        covering([2, 64], [6], cpu)


def test_caches_that_only_grow_keep_their_size_class():
    """On CUDA (StaticSteps.shrink False) a compiled model's caches only grow: a short request after a long
    one keeps the long one's size class (no other graph), and compile_levels warms that class alone;
    where they shrink (the CPU), each request takes its own class. Forced here on the CPU."""
    from polybasic.runtime.compiled import compile_levels
    from polybasic.runtime.generate import generate_tokens
    from polybasic.runtime.levels import ModelLevel

    hf = tiny_hf_llama(tie=True, max_pos=1024)
    lean = lean_from_hf(hf)
    for shrink, classes in ((True, {256, 512}), (False, {512})):
        compiled = lean_from_hf(hf)
        compile_for_device(compiled, sizes=(1, 8))
        compiled._static.shrink = shrink
        compile_levels([ModelLevel(compiled)], 300, lengths=[40, 300], decode=True)
        assert compiled.max_seq_len == 512
        warm = compiled._static.compiles
        assert warm == 2 * len(classes)  # two decoding steps per class warmed
        prompt = list(range(3, 40))
        assert list(generate_tokens(compiled, prompt, 8)) == list(generate_tokens(lean, prompt, 8))
        assert compiled.max_seq_len == (256 if shrink else 512)
        assert compiled._static.compiles == warm, "a request compiled a step compile_levels left out"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paths_run_the_tree_steps_with_their_own_bits(dtype):
    """A compiled model's path call of more than one row runs its size's tree step (one graph a size for paths and
    trees): the same logits and features as the path step it replaces; and a token tree's call after paths have run
    that step (its calls then skip dynamo's guards, then its wrappers) gets the bits of a fresh model's tree call, so
    the step's graph does not take a path's slots for the tree's logical positions."""
    from polybasic.models import bf16_rows
    from polybasic.models.decoder import Transformer

    hf = tiny_hf_llama(tie=True)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    parents = [-1, 0, 1, -1, 3]  # two branches from the prefix

    def run(as_trees: bool, paths: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        model = lean_from_hf(hf, dtype)
        bf16_rows.bind(model)
        compile_for_device(model, sizes=(1, 8, 16))
        model.setup_caches(120)
        out = []
        with torch.inference_mode():
            model(torch.tensor([ids[:16]]), 0, last_only=True)  # the prefill chunk's step
            for i in range(paths):  # 5 rows after the prefix: the 8-row step
                out.append(model(torch.tensor([ids[16 + i:21 + i]]), 16 + i))
            assert any(key[-1] for key in model._static.seen) == (as_trees and paths > 0)  # key[-1]: a tree step
            out.append(model(torch.tensor([ids[30:35]]), 16, parents=parents))
        return out

    try:
        Transformer.paths_as_trees = False
        apart = run(False, 4)
    finally:
        Transformer.paths_as_trees = True
    shared, fresh = run(True, 4), run(True, 0)
    for (la, ha), (lb, hb) in zip(apart, shared):
        assert torch.equal(la, lb) and torch.equal(ha, hb)
    assert torch.equal(shared[-1][0], fresh[-1][0]) and torch.equal(shared[-1][1], fresh[-1][1])
