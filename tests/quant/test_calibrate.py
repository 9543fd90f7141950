"""Calibration math and driver on tiny random models (init_std=0.2: non-trivial blocks)."""
import pytest
import torch

from polybasic.config import CalibrationConfig
from polybasic.errors import ConfigError
from polybasic.quant import calibrate as C
from polybasic.quant.calibrate import (
    CalibrationDiverged,
    affine_matrix,
    band_mask,
    block_forward,
    block_weights,
    build_quantized_model,
    calibrate,
    dominant,
    gradual_width,
    merge_transforms,
    rtn_block_mse,
)
from tests.helpers import TINY_HF, lean_from_hf, tiny_hf, tiny_hf_llama


@pytest.fixture(scope="module")
def tiny():
    return lean_from_hf(tiny_hf_llama(init_std=0.2, vocab=128, hidden=64, heads=4, kv_heads=2))


@pytest.fixture(scope="module", params=list(TINY_HF))
def tiny_any(request, tiny):
    """The Llama `tiny`, then the same shapes as a Qwen2 (q/k/v biases): calibration runs each
    family's own block."""
    if request.param == "llama":
        return tiny
    return lean_from_hf(tiny_hf(request.param, init_std=0.2, vocab=128, hidden=64, heads=4, kv_heads=2))


def _rope(model, n, length):
    model.setup_caches(length, n)
    return model.rope_cos[:length], model.rope_sin[:length]


def test_block_forward_matches_model_block(tiny_any):
    tiny = tiny_any
    x = torch.randn(2, 16, 64)
    cos, sin = _rope(tiny, 2, 16)
    ref = tiny.layers[0](x.clone(), cos, sin, None, 0)
    a = tiny.args
    y = block_forward(x, block_weights(tiny.layers[0]), a, cos, sin)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_merged_transforms_reproduce_fp_block(tiny_any):
    tiny = tiny_any
    """Equivalence: diagonal norm-side scales and per-head v->o matrices merged into the weights
    leave the block output unchanged when nothing is quantized."""
    torch.manual_seed(0)
    a = tiny.args
    d = a.head_dim
    x = torch.randn(2, 16, 64)
    cos, sin = _rope(tiny, 2, 16)
    w = block_weights(tiny.layers[1])
    params = {"s_attn": 0.5 * torch.randn(64), "s_ffn": 0.5 * torch.randn(64),
              "a_vo": torch.eye(d).repeat(a.n_kv_heads, 1, 1) + 0.5 * torch.randn(a.n_kv_heads, d, d)}
    w2 = merge_transforms(w, params, a.n_heads, a.n_kv_heads, d, band_mask(d, d, 1.0))
    assert not torch.allclose(w2["wqkv"], w["wqkv"]) and not torch.allclose(w2["wo"], w["wo"])
    f = lambda ww: block_forward(x, ww, a, cos, sin)  # noqa: E731
    torch.testing.assert_close(f(w2), f(w), rtol=1e-4, atol=1e-4)


def test_gradual_mask_and_dominance_keep_matrix_invertible():
    d = 16
    assert [gradual_width(e, 4, d) for e in range(4)] == [1, 6, 11, 16]
    m = band_mask(d, 3, 0.01)
    assert m[0, 0] == 1 and m[0, 2] == 0.01 and m[0, 3] == 0
    torch.manual_seed(0)
    for scale in (0.1, 10.0, 1000.0):  # even huge off-diagonal parameters
        p = torch.eye(d).repeat(3, 1, 1) + scale * torch.randn(3, d, d)
        for width in (1, 4, d):
            a = affine_matrix(p, band_mask(d, width, 1.0))  # [3, d, d]
            diag = torch.diagonal(a, dim1=-2, dim2=-1).abs()
            off = a.abs().sum(-1) - diag
            assert (off < diag).all()  # strictly diagonally dominant
            assert (torch.linalg.svdvals(a).amin(-1) > 0).all()
            torch.testing.assert_close(a @ torch.linalg.inv(a), torch.eye(d).expand(3, d, d), atol=1e-4, rtol=0)
    already = torch.eye(4) + 0.01
    torch.testing.assert_close(dominant(already), already)  # never scales up / touches dominant rows


@pytest.mark.parametrize("method", ["omniquant", "affinequant"])
def test_calibration_beats_rtn_block_mse(tiny, method):
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (8, 32))
    cfg = CalibrationConfig(method=method, w_bits=4, a_bits=4, group_size=16, n_samples=8, seq_len=32,
                            epochs=3, batch_size=2, lr_transform=1e-2, lr_clip=1e-2)
    rtn, cal = rtn_block_mse(tiny, tokens, cfg, layer=0)
    assert cal < 0.95 * rtn, (rtn, cal)


def test_quantized_model_matches_calibrated_fake_quant(tiny_any):
    tiny = tiny_any
    """The real model (dequant kernel) computes what calibration optimised."""
    tokens = torch.randint(0, 128, (4, 16))
    cfg = CalibrationConfig(method="affinequant", group_size=16, n_samples=4, seq_len=16, epochs=1)
    res = calibrate(tiny, tokens, cfg, progress=False)
    qm = build_quantized_model(tiny, res, cfg.quant_config("dequant"))
    a = tiny.args
    cos, sin = _rope(qm, 4, 16)
    with torch.no_grad():
        x = tiny.tok_embeddings(tokens)
        for i, r in enumerate(res):
            wq = C.fake_quantize_block(r["weights"], r["params"], cfg, f"layers.{i}")
            x = block_forward(x, wq, a, cos, sin, 4)
        _, hidden = qm(tokens, 0)
    torch.testing.assert_close(hidden, x, rtol=1e-4, atol=1e-4)


def test_nan_loss_names_layer_and_keeps_last_good_state(tiny, tmp_path, monkeypatch):
    tokens = torch.randint(0, 128, (4, 16))
    cfg = CalibrationConfig(method="omniquant", group_size=16, n_samples=4, seq_len=16, epochs=2, batch_size=2)
    calls = {"n": 0}
    real = C.block_loss

    def flaky(out, target):  # finite for block 0 (4 steps) and the first step of block 1
        calls["n"] += 1
        return real(out, target) * (float("nan") if calls["n"] > 5 else 1.0)

    monkeypatch.setattr(C, "block_loss", flaky)
    with pytest.raises(CalibrationDiverged, match=r"layers\.1: calibration loss is nan") as e:
        calibrate(tiny, tokens, cfg, tmp_path, progress=False)
    assert e.value.layer == "layers.1"
    assert all(torch.isfinite(v).all() for v in e.value.params.values())
    assert (tmp_path / "block_000.pt").is_file() and not (tmp_path / "block_001.pt").exists()
    monkeypatch.setattr(C, "block_loss", real)  # resume: block 0 is reused, not retrained
    calls["n"] = 0
    calibrate(tiny, tokens, cfg, tmp_path, progress=False)
    assert (tmp_path / "block_001.pt").is_file()


def test_group_size_error_names_layer(tiny):
    cfg = CalibrationConfig(method="rtn", group_size=48, n_samples=2, seq_len=8, epochs=0)
    with pytest.raises(ConfigError, match=r"layers\.0\.attention\.wqkv: group_size 48"):
        calibrate(tiny, torch.zeros(2, 8, dtype=torch.long), cfg, progress=False)


def test_config_errors_name_field():
    with pytest.raises(ConfigError, match="CalibrationConfig.method"):
        CalibrationConfig(method="gptq")
    with pytest.raises(ConfigError, match="CalibrationConfig.epochs"):
        CalibrationConfig(epochs=-1)
