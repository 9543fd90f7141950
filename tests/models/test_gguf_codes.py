"""GGUF block codes: parsing equals gguf's own expansion, rows are found in fused linears and a
weight that differs is refused, and compiled one-token steps that read the codes match eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from polybasic.models import gguf_codes
from polybasic.models.gguf_codes import BLOCK, _parse, attach_codes, read_codes
from polybasic.runtime.generate import generate_tokens
from tests.helpers import lean_from_hf, tiny_hf_llama

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
    assert compiled.compile_decode(path) == len(linears)
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
