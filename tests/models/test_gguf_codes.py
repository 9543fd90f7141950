"""GGUF block codes: parsing equals gguf's own expansion (legacy and k-quant blocks), rows are found
in fused linears (also across block types) and a weight that differs is refused, compiled one-token
steps that read the codes match eager, and a tiny Qwen2 GGUF with k-quant tensors loads."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from polybasic.models import gguf_codes
from polybasic.models.gguf_codes import BLOCK, _parse, attach_codes, read_codes
from polybasic.models.gguf_codes import BLOCK_QUANT_TYPES as READ_KINDS
from polybasic.models.prepare import compile_for_device
from polybasic.runtime.generate import generate_tokens
from tests.helpers import lean_from_hf, tiny_hf, tiny_hf_llama

KINDS = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q8_0": Q.Q8_0}


def _expand(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, the fp32 values gguf expands them to) for w [N, K]."""
    raw = quantize(w.astype(np.float32), KINDS[kind])
    return raw, dequantize(raw, KINDS[kind]).reshape(w.shape).astype(np.float32)


@pytest.mark.parametrize("kind", list(KINDS))
def test_block_codes_expand_exactly_like_gguf(kind):
    w = np.random.default_rng(0).standard_normal((8, 3 * BLOCK)).astype(np.float32)
    raw, ref = _expand(w, kind)
    codes = _parse(kind, raw.reshape(8 * 3, -1), 8, 3 * BLOCK)
    assert codes.codes.shape == (8, 3, BLOCK) and codes.scale.shape == (8, 3, 1)
    assert (codes.minimum is not None) == (kind == "Q4_1")
    assert torch.equal(codes.dequantize(), torch.from_numpy(ref))


def _gguf_model(tmp_path):
    """A tiny lean model whose fp32 weights are the expansion of a GGUF file written here: q, k, v
    and gate, up as separate tensors in shuffled order and rows, as a converter may store them."""
    lean = lean_from_hf(tiny_hf_llama(tie=True))
    rng = np.random.default_rng(1)
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    linears = {id(m): m for m in lean.modules() if isinstance(m, torch.nn.Linear)}.values()
    for i, lin in enumerate(linears):
        w = lin.weight.detach().numpy()
        kind = "Q8_0" if lin is lean.output else ("Q4_1", "Q4_0")[i % 2]
        parts = np.array_split(np.arange(w.shape[0]), 3 if lin.out_features > lin.in_features else 1)
        expanded = np.empty_like(w)
        for j, rows in enumerate(reversed(parts)):
            rows = rng.permutation(rows)
            raw, values = _expand(w[rows], kind)
            expanded[rows] = values
            writer.add_tensor(f"t{i}.{j}", raw, raw_dtype=KINDS[kind])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(expanded))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return lean, tmp_path / "tiny.gguf", list(linears)


def test_attach_codes_finds_every_row_and_refuses_a_different_weight(tmp_path):
    lean, path, linears = _gguf_model(tmp_path)
    assert len(read_codes(path)) > len(linears)  # fused linears were written as several tensors
    with torch.no_grad():  # one value off by one ulp: that linear must keep its fp32 weight only
        w = lean.layers[1].feed_forward.w2.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))
    assert attach_codes(lean, path) == len(linears) - 1
    assert getattr(lean.layers[1].feed_forward.w2, "codes", None) is None
    for lin in linears:
        if lin is not lean.layers[1].feed_forward.w2:
            expanded = gguf_codes.BlockCodes(lin.codes, lin.code_scale, lin.code_min).dequantize()
            assert torch.equal(expanded, lin.weight)


def test_compiled_steps_read_the_codes_and_match_eager(tmp_path):
    lean, path, linears = _gguf_model(tmp_path)
    compiled = lean_from_hf(tiny_hf_llama(tie=True))
    compiled.load_state_dict(lean.state_dict())
    assert compile_for_device(compiled, path) == len(linears)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    lean.setup_caches(64)
    compiled.setup_caches(64)
    with torch.inference_mode():
        lean(ids[:, :20], 0)
        compiled(ids[:, :20], 0)
        ref = torch.cat([lean(ids[:, i:i + 1], i)[0] for i in range(20, 30)], 1)
        got = torch.cat([compiled(ids[:, i:i + 1], i)[0] for i in range(20, 30)], 1)
    torch.testing.assert_close(got, ref)
    prompt = ids[0, :12].tolist()
    assert list(generate_tokens(compiled, prompt, 16)) == list(generate_tokens(lean, prompt, 16))
    # the step really reads the codes: scaling one linear's block scales (not its fp32 weight) moves
    # the logits, and doubling the LM head's (Q8_0: no minimum) doubles them exactly
    coded = [m for m in compiled.modules() if getattr(m, "codes", None) is not None]
    assert len(coded) == len(linears)
    with torch.inference_mode():
        before = compiled(ids[:, 29:30], 29)[0]
        for lin in coded:
            lin.code_scale.mul_(2.0)  # the buffers are live inputs of the compiled graph
            after = compiled(ids[:, 29:30], 29)[0]
            lin.code_scale.div_(2.0)
            if lin is compiled.output:
                assert torch.equal(after, 2 * before)
            else:
                assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
    with torch.inference_mode():  # a k-token verification step reads the codes too (up to CODED_ROWS rows)
        ref3, got3 = lean(ids[:, 26:29], 26)[0], compiled(ids[:, 26:29], 26)[0]
        compiled.output.code_scale.mul_(2.0)
        twice = compiled(ids[:, 26:29], 26)[0]
        compiled.output.code_scale.div_(2.0)
    torch.testing.assert_close(got3, ref3)
    assert torch.equal(twice, 2 * got3)


# byte offsets of the f16 fields (scale d, minimum / dmin) inside one block of each type
F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, n: int, k: int, rng, scale: float = 1e-3) -> np.ndarray:
    """Random raw blocks [n * k / block, bytes] of an [n, k] tensor: every code and packed scale
    random, the f16 fields finite (random bytes there could be NaN, which never compares equal)."""
    per, nbytes = GGML_QUANT_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (n * k // per, nbytes), dtype=np.uint8)
    for at in F16_AT[kind]:
        raw[:, at:at + 2] = (rng.uniform(-scale, scale, (raw.shape[0], 1))).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", READ_KINDS)
def test_every_block_type_expands_bit_for_bit_like_gguf(kind):
    """Synthetic random blocks (gguf-py cannot write k-quants): our codes * scales (+ minimum) are
    gguf.quants.dequantize's fp32 values exactly."""
    n, k = 3, 512
    raw = random_blocks(kind, n, k, np.random.default_rng(len(kind) + ord(kind[1])), scale=10.0)
    codes = _parse(kind, raw, n, k)
    assert codes.codes.shape[-1] == (16 if kind == "Q6_K" else 32)
    ref = dequantize(raw, Q[kind]).reshape(n, k)
    assert torch.equal(codes.dequantize(), torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))


def test_rows_of_different_block_types_share_one_layout():
    """A fused linear whose rows come from Q4_K, Q6_K and Q8_0 tensors gets one layout (groups of
    16, signed codes, zero minimum where there is none) that expands to the same values."""
    rng = np.random.default_rng(5)
    parts = [_parse(kind, random_blocks(kind, 2, 256, rng), 2, 256) for kind in ("Q4_K", "Q6_K", "Q8_0")]
    codes, scale, minimum = gguf_codes._stack_rows(parts, [(0, 1), (1, 0), (2, 1)])
    assert codes.shape == (3, 16, 16) and codes.dtype == torch.int8 and minimum is not None
    ref = torch.stack([parts[0].dequantize()[1], parts[1].dequantize()[0], parts[2].dequantize()[1]])
    assert torch.equal(gguf_codes.BlockCodes(codes, scale, minimum).dequantize(), ref)


QWEN2_KINDS = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
               "ffn_gate": "Q4_K", "ffn_up": "Q6_K", "ffn_down": "Q5_0", "token_embd": "Q8_0"}


def write_qwen2_gguf(hf, path, rng, kinds=None) -> None:
    """A Qwen2 GGUF of hf's shapes, as llama.cpp's Q4_K_M mixes block types: its 2-D tensors are
    random blocks of `kinds` (default QWEN2_KINDS; so the weights are the GGUF's, not hf's), norms and biases hf's."""
    kinds = kinds or QWEN2_KINDS
    from tokenizers.pre_tokenizers import ByteLevel

    c = hf.config
    w = GGUFWriter(str(path), "qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = sorted(ByteLevel.alphabet())[:c.vocab_size]  # byte-level BPE symbols, no merges
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    sub = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, value in hf.state_dict().items():
        stem, kind = key.rsplit(".", 1)
        if stem == "lm_head":
            continue  # tied
        if stem in top:
            name = top[stem]
        else:
            layer, _, rest = stem.removeprefix("model.layers.").partition(".")
            name = f"blk.{layer}.{sub[rest]}"
        if value.dim() == 2:
            qkind = kinds[name.rsplit(".", 1)[-1]]
            raw = random_blocks(qkind, *value.shape, rng, 1e-3)
            w.add_tensor(f"{name}.{kind}", raw.reshape(value.shape[0], -1), raw_dtype=Q[qkind])  # a byte row per row
        else:
            w.add_tensor(f"{name}.{kind}", value.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_qwen2_gguf_with_k_quants_loads_and_steps_read_its_codes(tmp_path, monkeypatch):
    """load_model(x.gguf) on a Qwen2 GGUF with Q4_K/Q5_K/Q6_K/Q5_0/Q8_0 tensors: the lean logits
    equal transformers' on the same file, every linear gets codes that expand to its fp32 weight
    bit for bit (q/k/v mix three block types), and compiled coded steps (bias added) match eager."""
    from polybasic.models.loader import load_hf_model, load_model

    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf("qwen2", tie=True, hidden=256, heads=4, kv_heads=2)  # k-quant rows: multiples of 256
    write_qwen2_gguf(hf, tmp_path / "tiny-qwen2.gguf", np.random.default_rng(2))
    lm = load_model(str(tmp_path / "tiny-qwen2.gguf"))
    ref = load_hf_model(str(tmp_path / "tiny-qwen2.gguf"))
    assert (lm.args.family, lm.args.qkv_bias, lm.args.rope_theta) == ("qwen2", True, 1e6)
    assert lm.gguf_file == tmp_path / "tiny-qwen2.gguf"
    # serving engines (vLLM) pick the model class from the converted folder's config
    assert json.loads((lm.hf_folder / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    eager = load_model(str(tmp_path / "tiny-qwen2.gguf")).model
    eager.setup_caches(64)
    with torch.inference_mode():
        want = ref(ids).logits
        got, _ = eager(ids, 0)
    torch.testing.assert_close(got, want)
    model = lm.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert compile_for_device(model, lm.gguf_file) == len(linears)
    for lin in linears:
        assert torch.equal(gguf_codes.BlockCodes(lin.codes, lin.code_scale, lin.code_min).dequantize(), lin.weight)
    assert model.layers[0].attention.wqkv.codes.shape[-1] == 16  # Q6_K v rows: groups of 16 for all
    model.setup_caches(64)
    with torch.inference_mode():
        model(ids[:, :16], 0)
        steps = torch.cat([model(ids[:, i:i + 1], i)[0] for i in range(16, 24)], 1)
    # the fused coded matvec sums in another order than BLAS (compile_steps' contract): float
    # rounding only, on logits of magnitude ~1-10 here
    torch.testing.assert_close(steps, want[:, 16:24], rtol=1e-4, atol=1e-4)


def test_rows_with_alike_ends_are_told_apart_by_their_whole_values(tmp_path):
    """attach_codes looks rows up by their first and last 32 values, then checks them whole: a row of
    another tensor with the same ends but another middle (found first) must not stop the right one."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 4 * BLOCK)).astype(np.float32)
    decoy = w.copy()
    decoy[:, BLOCK:2 * BLOCK] += 1.0  # same ends, another middle block
    writer = GGUFWriter(str(tmp_path / "alike.gguf"), "llama")
    for name, rows in (("decoy", decoy), ("real", w)):  # the decoy is indexed first
        writer.add_tensor(name, quantize(rows, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    lin = torch.nn.Linear(4 * BLOCK, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(_expand(w, "Q8_0")[1]))
    model = torch.nn.Sequential(lin)
    assert attach_codes(model, tmp_path / "alike.gguf") == 1
    assert torch.equal(gguf_codes.BlockCodes(lin.codes, lin.code_scale, lin.code_min).dequantize(), lin.weight)
