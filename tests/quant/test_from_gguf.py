"""Method 'gguf': a W4 copy that keeps a GGUF file's own 4-bit codes (float zero points)."""
import json

import numpy as np
import pytest
import torch
import yaml

from polybasic.config import QuantConfig
from polybasic.errors import ConfigError
from polybasic.quant.from_gguf import GGUFCodes, rtn_float_zero
from polybasic.quant.linear import Int4PackLinear
from polybasic.quant.primitives import dequantize_weight
from tests.helpers import tiny_hf
from tests.models.test_gguf_codes import QWEN2_KINDS, write_qwen2_gguf
from tests.pipelines.test_quantize import _data


def test_rtn_float_zero_spans_each_group_exactly():
    """Codes -8 and 7 land on each group's minimum and maximum (no widening to contain 0, unlike the
    integer zero point), and every value is within half a step."""
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(0)) + 3.0  # groups far from 0
    q, scale, zero = rtn_float_zero(w, 32)
    assert q.dtype == torch.int8 and int(q.min()) == -8 and int(q.max()) == 7 and zero.dtype == torch.float32
    deq = dequantize_weight(q, scale, zero)
    step = scale.repeat_interleave(32, 1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    lo = w.reshape(8, 3, 32).amin(-1)
    torch.testing.assert_close(deq.reshape(8, 3, 32).amin(-1), lo, rtol=1e-6, atol=1e-6)


def test_float_zero_int4pack_matches_its_dequantized_weight():
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=32, method="gguf", kernel="int4pack")
    q, scale, zero = rtn_float_zero(torch.randn(48, 256, generator=torch.Generator().manual_seed(1)) + 1.0)
    mod = Int4PackLinear.from_quantized(q, scale, zero, cfg)
    assert mod.zero.dtype == torch.float32 and torch.equal(mod.zero, zero)
    x = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(2))
    ref = torch.nn.functional.linear(x, mod.dequantized_weight())
    torch.testing.assert_close(mod(x), ref, rtol=1e-5, atol=1e-5)
    yb = mod(x.to(torch.bfloat16)).float()
    assert (yb - ref).norm() / ref.norm() < 1e-2
    dense = mod.dense_weight(torch.bfloat16).float()
    assert (dense - mod.dequantized_weight()).norm() / mod.dequantized_weight().norm() < 1e-2


def test_gguf_method_config_is_checked():
    with pytest.raises(ConfigError, match="group_size=64"):
        QuantConfig(method="gguf", group_size=64)
    with pytest.raises(ConfigError, match="int8mm"):
        QuantConfig(method="gguf", group_size=32, w_bits=4, a_bits=8, kernel="int8mm")


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf("qwen2", tie=True, hidden=256, heads=4, kv_heads=2)  # k-quant rows: multiples of 256
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(hf, path, np.random.default_rng(2))
    return path


def test_codes_keep_the_files_4bit_rows_and_round_the_others(tiny_gguf):
    """q rows (Q4_K) come back as the file's values (fp32 rounding only); k (Q5_K) and v (Q6_K) rows
    are rounded within half a step; the exact fraction counts the Q4_K weights."""
    from polybasic.models.loader import load_model

    lm = load_model(str(tiny_gguf))
    codes = GGUFCodes.read(tiny_gguf)
    att = lm.model.layers[0].attention
    w = att.wqkv.weight  # [q rows | k rows | v rows, 256]
    q, scale, zero = codes.quantize(w, "wqkv")
    deq = dequantize_weight(q, scale, zero)
    nq = att.n_heads * att.head_dim
    step = scale.repeat_interleave(32, 1).abs()  # the file's d may be negative
    # the file's own grid, up to fp32 rounding (and groups whose scale is 0: codes times 1e-8)
    assert ((deq[:nq] - w[:nq]).abs() <= 2e-6 * (w[:nq].abs() + 16 * step[:nq]) + 2e-7).all()
    assert ((deq[nq:] - w[nq:]).abs() <= step[nq:] / 2 * (1 + 1e-5) + 1e-7).all()  # ties: fp32 rounding
    assert not torch.equal(deq[nq:], w[nq:])  # 5- and 6-bit rows do lose something
    assert codes.exact == nq * 256 and codes.total == w.numel()
    assert QWEN2_KINDS["attn_q"] == "Q4_K" and QWEN2_KINDS["attn_k"] != "Q4_K"


def test_quantize_stage_with_gguf_codes_gives_a_lossless_chain_level(tiny_gguf, tmp_path):
    """`quantize` with calib.method gguf on a GGUF source: int4pack copy with float zero points whose
    Q4_K rows are the file's, a report that says how many weights kept their codes, and a greedy
    chain through the copy equal to vanilla. A source without a GGUF file is refused by name."""
    from polybasic.models.decoder import Transformer
    from polybasic.models.loader import load_model
    from polybasic.pipelines.run import run_recipe
    from polybasic.quant import load_quantized
    from polybasic.runtime.chain import Chain
    from polybasic.runtime.chain_builder import parse_chain
    from polybasic.runtime.generate import generate_tokens

    r = {"name": "tiny", "out_dir": str(tmp_path / "out"), "model": {"source": str(tiny_gguf)},
         "quantize": {"calib": {"method": "gguf", "w_bits": 4, "a_bits": 16, "group_size": 32,
                                "n_samples": 2, "seq_len": 16},
                      "data": str(_data(tmp_path / "d.jsonl")), "holdout": 6, "eval_seq_len": 16,
                      "eval_windows": 2, "schemes": ["w4a16"], "methods": ["gguf"], "kernel": "int4pack",
                      "exec_dtype": "bfloat16", "quantize_lm_head": True, "latency_reps": 0}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    run_recipe(str(path), only=("quantize",))
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert 0 < report["main"]["gguf_code_fraction"] < 1
    assert "keep the GGUF file's own 4-bit codes" in (out / "report.md").read_text()
    target = load_model(str(tiny_gguf))
    qm = load_quantized(out / "model.safetensors", lambda: Transformer(target.args))
    wqkv = qm.layers[1].attention.wqkv
    assert isinstance(wqkv, Int4PackLinear) and wqkv.zero.dtype == torch.float32
    nq = target.args.n_heads * target.args.head_dim
    want = target.model.layers[1].attention.wqkv.weight[:nq]
    step = wqkv.scale[:nq].abs().repeat_interleave(32, 1)
    assert ((wqkv.dequantized_weight()[:nq] - want).abs() <= 2e-6 * (want.abs() + 16 * step) + 2e-7).all()
    levels = parse_chain(str(out / "model.safetensors"), target)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    assert Chain(levels, k=3).generate(prompt, 16)[0] == list(generate_tokens(target.model, prompt, 16))

    from tests.helpers import tiny_hf_folder

    tiny_hf_folder(tmp_path / "folder", vocab=64, hidden=64, heads=4, kv_heads=2)
    r["model"]["source"] = str(tmp_path / "folder")
    r["out_dir"] = str(tmp_path / "out2")
    path.write_text(yaml.safe_dump(r))
    with pytest.raises(ConfigError, match="'gguf' keeps the codes"):
        run_recipe(str(path), only=("quantize",))
