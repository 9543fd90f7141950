"""Rounding primitives bit-exact against a per-element reference written from the definitions."""
import pytest
import torch

from polybasic.errors import ConfigError
from polybasic.quant.primitives import (
    dequantize_weight,
    fake_quantize_activation,
    fake_quantize_weight,
    pack_int4,
    quantize_activation,
    quantize_weight,
    round_ste,
    unpack_int4,
)


def ref_quantize_rows(rows, bits, symmetric):
    """rows: list of lists of 0-d fp32 tensors (one group each) -> codes, scale, zero per group."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    codes, scales, zeros = [], [], []
    for vals in rows:
        lo = min(min(vals), torch.tensor(0.0))
        hi = max(max(vals), torch.tensor(0.0))
        if symmetric:
            s = max(max(-lo, hi) / qmax, torch.tensor(1e-8))
            z = torch.tensor(0.0)
        else:
            s = max((hi - lo) / (qmax - qmin), torch.tensor(1e-8))
            z = min(max(qmin - torch.round(lo / s), torch.tensor(float(qmin))), torch.tensor(float(qmax)))
        cs = [min(max(torch.round(v / s) + z, torch.tensor(float(qmin))), torch.tensor(float(qmax)))
              for v in vals]
        codes.append(cs), scales.append(s), zeros.append(z)
    return codes, scales, zeros


def ref_weight(w, bits, group_size, symmetric):
    out, k = w.shape
    gs = k if group_size == -1 else group_size
    rows = [[w[r, g * gs + i] for i in range(gs)] for r in range(out) for g in range(k // gs)]
    codes, scales, zeros = ref_quantize_rows(rows, bits, symmetric)
    q = torch.tensor([[float(c) for c in cs] for cs in codes]).reshape(out, k).to(torch.int8)
    scale = torch.stack(scales).reshape(out, k // gs)
    zero = torch.stack(zeros).reshape(out, k // gs)
    deq = torch.stack([torch.stack([(c - z) * s for c in cs]) for cs, s, z in zip(codes, scales, zeros)])
    return q, scale, zero.to(torch.int8), deq.reshape(out, k)


def sample_weight(out=6, k=64, seed=0):
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0.0  # an all-zero group
    w[1] = w[1].abs() + 0.5  # all positive
    w[2] = -w[2].abs()  # all negative
    w[3, 5] = 9.0  # an outlier
    return w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [16, 32, -1])
@pytest.mark.parametrize("symmetric", [False, True])
def test_weight_quantization_bit_exact(bits, group_size, symmetric):
    w = sample_weight()
    q, scale, zero = quantize_weight(w, bits, group_size, symmetric)
    rq, rscale, rzero, rdeq = ref_weight(w, bits, group_size, symmetric)
    assert torch.equal(q, rq) and torch.equal(scale, rscale) and torch.equal(zero, rzero)
    deq = dequantize_weight(q, scale, zero)
    assert torch.equal(deq, rdeq)
    assert torch.equal(fake_quantize_weight(w, bits, group_size, symmetric), rdeq)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert int(q.min()) >= lo and int(q.max()) <= hi
    assert torch.equal(deq[0, :32], torch.zeros(32)) if group_size != -1 else True


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_activation_quantization_bit_exact(bits, symmetric):
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1))
    x[0, 0] = x[0, 0].abs()  # a token with no negative entry
    q, scale, zero = quantize_activation(x, bits, symmetric)
    rows = [[x[b, t, i] for i in range(40)] for b in range(2) for t in range(3)]
    codes, scales, zeros = ref_quantize_rows(rows, bits, symmetric)
    rq = torch.tensor([[float(c) for c in cs] for cs in codes]).reshape(2, 3, 40).to(torch.int8)
    assert torch.equal(q, rq)
    assert torch.equal(scale, torch.stack(scales).reshape(2, 3, 1))
    assert torch.equal(zero, torch.stack(zeros).reshape(2, 3, 1).to(torch.int32))
    rdeq = torch.stack([torch.stack([(c - z) * s for c in cs]) for cs, s, z in zip(codes, scales, zeros)])
    assert torch.equal(fake_quantize_activation(x, bits, symmetric), rdeq.reshape(2, 3, 40))
    assert fake_quantize_activation(x, 16, symmetric) is x


def test_bf16_input_quantizes_in_fp32():
    w = sample_weight().to(torch.bfloat16)
    q, s, z = quantize_weight(w, 4, 32, False)
    rq, rs, rz, _ = ref_weight(w.float(), 4, 32, False)
    assert torch.equal(q, rq) and torch.equal(s, rs) and s.dtype == torch.float32
    assert fake_quantize_weight(w, 4, 32, False).dtype == torch.bfloat16


def test_round_ste_gradient_is_identity():
    x = torch.tensor([0.2, 0.5, 1.5, -2.7, 3.49], requires_grad=True)
    y = round_ste(x)
    assert torch.equal(y, x.detach().round())
    g = torch.tensor([1.0, -2.0, 3.0, 0.5, 7.0])
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_learnable_clipping_gradients_and_consistency():
    w = sample_weight()
    gamma = torch.full((6, 2), 2.0, requires_grad=True)
    beta = torch.full((6, 2), 2.0, requires_grad=True)
    ww = w.clone().requires_grad_(True)
    fq = fake_quantize_weight(ww, 4, 32, False, gamma, beta)
    (fq * torch.randn_like(fq)).sum().backward()
    assert gamma.grad.abs().sum() > 0 and beta.grad.abs().sum() > 0 and ww.grad.abs().sum() > 0
    # the stored codes with the same clipping dequantize to exactly the fake-quantized weight
    q, s, z = quantize_weight(w, 4, 32, False, gamma.detach(), beta.detach())
    assert torch.equal(dequantize_weight(q, s, z), fq.detach())
    # clipping shrinks the range: the outlier is clipped
    assert dequantize_weight(q, s, z)[3, 5] < 9.0 * torch.sigmoid(torch.tensor(2.0)) + 1e-6
    # sigmoid(30) == 1 in fp32: no clipping, identical to plain RTN
    big = torch.full((6, 2), 30.0)
    assert torch.equal(fake_quantize_weight(w, 4, 32, True, big), fake_quantize_weight(w, 4, 32, True))


def test_pack_int4_round_trip():
    q = torch.randint(-8, 8, (5, 32), dtype=torch.int8)
    p = pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (5, 16)
    assert torch.equal(unpack_int4(p), q)


def test_group_size_not_dividing_names_layer_and_valid_sizes():
    with pytest.raises(ConfigError, match=r"layers\.3\.w2: group_size 48 does not divide in_features=64.*-1.*32"):
        quantize_weight(torch.randn(4, 64), 4, 48, False, name="layers.3.w2")
