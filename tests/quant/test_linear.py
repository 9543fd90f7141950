"""Real low-bit kernels against F.linear over the dequantized weight (the module's own reference)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polybasic.config import QuantConfig
from polybasic.errors import ConfigError
from polybasic.quant.linear import DequantLinear, Int4PackLinear, Int8MMLinear, choose_kernel
from polybasic.quant.primitives import fake_quantize_activation, quantize_weight


def make_linear(k=128, n=64, bias=False, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


def reference(mod, x, quantize_acts=True):
    """fp32 F.linear of the (fake-quantized) activations and the dequantized weight."""
    xr = x.float()
    if quantize_acts:
        xr = fake_quantize_activation(xr, mod.a_bits, mod.a_symmetric)
    return F.linear(xr, mod.dequantized_weight(), None if mod.bias is None else mod.bias.float())


ROWS = [1, 5, 20]  # decode, verify chunk, > 16 (the int8 GEMM's large-M path)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("sym", [False, True])
def test_int4pack_matches_dequantized_linear(m, group_size, sym):
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=group_size, w_symmetric=sym, kernel="int4pack")
    mod = Int4PackLinear.from_float(make_linear(256, 48, bias=True), cfg)
    x = torch.randn(1, m, 256, generator=torch.Generator().manual_seed(m))
    # fp32 activations: the kernel accumulates in fp32 with fp32 scales -> fp32 rounding only
    torch.testing.assert_close(mod(x), reference(mod, x), rtol=1e-5, atol=1e-5)
    # bf16 activations: scales, zeros, inputs and output rounded to bf16 (eps 2^-8): 2% of the
    # largest output as absolute tolerance, and a relative L2 error below 1%
    xb = x.to(torch.bfloat16)
    y, ref = mod(xb), reference(mod, xb)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert (y.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4pack_dense_prefill_weight(group_size):
    """The CPU prefill path (>= gemm_rows rows) expands the nibbles in bf16: within one bf16 rounding
    of each term of the fp32 dequantization, and its GEMM agrees with the reference like the kernel."""
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=group_size, kernel="int4pack")
    mod = Int4PackLinear.from_float(make_linear(256, 48, bias=True), cfg)
    ref_w = mod.dequantized_weight()
    w = mod.dense_weight(torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.shape == ref_w.shape
    scale = mod.scale.repeat_interleave(group_size, 1)  # [out, in]
    assert ((w.float() - ref_w).abs() <= 2 ** -7 * (ref_w.abs() + 16 * scale)).all()
    x = torch.randn(1, mod.gemm_rows, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y, ref = mod(x), reference(mod, x)
    assert mod._dense_rows == mod.gemm_rows and y.dtype == torch.bfloat16
    assert (y.float() - ref).norm() / ref.norm() < 1e-2
    from polybasic.quant.linear import keep_dense_for_prefill

    assert mod._dense is None and keep_dense_for_prefill(nn.Sequential(mod)) == 1
    assert torch.equal(mod(x), y) and torch.equal(mod._dense, w)  # kept: the same weight, the same output
    assert torch.equal(mod(x[:, :1]), Int4PackLinear.forward(mod, x[:, :1]))  # one row: the kernel


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("w_sym, a_sym", [(False, False), (True, True), (False, True), (True, False)])
def test_int8mm_matches_dequantized_linear(m, bits, w_sym, a_sym):
    cfg = QuantConfig(w_bits=bits, a_bits=bits, group_size=-1, w_symmetric=w_sym, a_symmetric=a_sym,
                      kernel="int8mm")
    mod = Int8MMLinear.from_float(make_linear(96, 40, bias=True), cfg)
    x = torch.randn(2, m, 96, generator=torch.Generator().manual_seed(m)) + 0.3
    # the int32 accumulation is exact; only the final fp32 rescale and the reference's own fp32
    # sum round: 1e-5 relative
    ref = reference(mod, x)
    torch.testing.assert_close(mod(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # bf16 activations are quantized in fp32 from the bf16 values; output rounded to bf16
    xb = x.to(torch.bfloat16)
    ref = reference(mod, xb)
    torch.testing.assert_close(mod(xb).float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("w_bits, a_bits, group_size", [(4, 4, 32), (8, 16, 64), (4, 16, -1), (8, 8, 16)])
def test_dequant_is_exactly_the_reference(w_bits, a_bits, group_size):
    cfg = QuantConfig(w_bits=w_bits, a_bits=a_bits, group_size=group_size, kernel="dequant")
    mod = DequantLinear.from_float(make_linear(), cfg)
    x = torch.randn(3, 7, 128)
    assert torch.equal(mod(x), reference(mod, x))


def test_weight_only_int4pack_ignores_a_bits():
    cfg = QuantConfig(w_bits=4, a_bits=4, group_size=64, kernel="int4pack")
    mod = Int4PackLinear.from_float(make_linear(), cfg)
    x = torch.randn(4, 128)
    torch.testing.assert_close(mod(x), reference(mod, x, quantize_acts=False), rtol=1e-5, atol=1e-5)


def test_from_quantized_holds_codes_not_float_weights():
    lin = make_linear()
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack")
    q, s, z = quantize_weight(lin.weight, 4, 32, False)
    mod = Int4PackLinear.from_quantized(q, s, z, cfg)
    assert torch.equal(mod.codes(), q) and torch.equal(mod.scale, s)
    assert not any(t.is_floating_point() and t.numel() >= q.numel() for t in mod.state_dict().values())
    assert mod.qweight.dtype == torch.uint8 and mod.qweight.shape == (64, 64)
    assert "kernel=int4pack" in repr(mod) and "w4a16" in repr(mod)
    with pytest.raises(ConfigError, match="scale/zero shapes"):
        Int4PackLinear.from_quantized(q, s[:, :2], z[:, :2], cfg, name="x")


def test_kernel_shape_limits_are_clear():
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=32, kernel="int4pack")
    with pytest.raises(ConfigError, match=r"blk\.0: kernel 'int4pack' out_features=40 is not a multiple of 16"):
        Int4PackLinear.from_float(make_linear(128, 40), cfg, name="blk.0")
    with pytest.raises(ConfigError, match=r"blk\.1: kernel 'int4pack' out_features=40"):
        choose_kernel(cfg, 128, 40, "cpu", "blk.1")
    auto = QuantConfig(w_bits=4, a_bits=16, group_size=32)
    assert choose_kernel(auto, 128, 40, "cpu") == "dequant"
    assert choose_kernel(auto, 128, 48, "cpu") == "int4pack"
    assert choose_kernel(QuantConfig(w_bits=4, a_bits=4, group_size=-1), 128, 40, "cpu") == "int8mm"
    assert choose_kernel(QuantConfig(w_bits=4, a_bits=4, group_size=32), 128, 40, "cpu") == "dequant"
    with pytest.raises(ConfigError, match="even in_features"):
        DequantLinear.from_float(make_linear(33, 16), QuantConfig(group_size=-1, kernel="dequant"), name="odd")
