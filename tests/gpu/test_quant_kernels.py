"""CUDA quantized kernels (int4 weight-only tinygemm, int8 x int8 _int_mm) against F.linear over the
dequantized weight, on SmolLM2-135M's linear shapes with random weights. Skipped without CUDA."""
import pytest
import torch

from polybasic.config import QuantConfig
from polybasic.quant.linear import Int4PackLinear, Int8MMLinear
from tests.devices import GPU
from tests.quant.test_linear import reference

pytestmark = GPU

SHAPES = [(576, 576), (576, 1536), (1536, 576)]  # (in, out): attention, up-projection, down-projection
ROWS = [1, 6, 17, 300]  # decode, (k+1)-token verification, past cuBLASLt's M > 16, a prefill


def cuda_linear(k: int, n: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=True).cuda()


@pytest.mark.parametrize("k, n, group_size", [(k, n, g) for k, n in SHAPES for g in (32, 64, 128)
                                              if k % g == 0])  # 128 does not divide 576 (ConfigError)
def test_int4pack_cuda_matches_dequantized_linear(k, n, group_size):
    cfg = QuantConfig(w_bits=4, a_bits=16, group_size=group_size, kernel="int4pack")
    mod = Int4PackLinear.from_float(cuda_linear(k, n, seed=k + n), cfg)
    assert mod._mm is torch.ops.aten._weight_int4pack_mm and mod._dense_rows is None  # the CUDA kernel, bound
    for m in ROWS:
        x = torch.randn(1, m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
        xb = x.to(torch.bfloat16)  # the CUDA tinygemm kernel takes bf16 activations
        y, ref = mod(xb), reference(mod, xb)
        assert y.dtype == torch.bfloat16 and y.shape == (1, m, n)
        # scales, zeros, inputs and output rounded to bf16 (eps 2^-8), fp32 accumulation: 2% of the
        # largest output as absolute tolerance, and a relative L2 error below 1% (the CPU test's contract)
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        assert (y.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("w_sym, a_sym", [(False, False), (True, True)])
def test_int8mm_cuda_matches_dequantized_linear(k, n, w_sym, a_sym):
    cfg = QuantConfig(w_bits=8, a_bits=8, group_size=-1, w_symmetric=w_sym, a_symmetric=a_sym, kernel="int8mm")
    mod = Int8MMLinear.from_float(cuda_linear(k, n, seed=k * n), cfg)
    for m in ROWS:  # M <= 16 is padded to 17 rows for cuBLASLt
        x = torch.randn(2, m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)) + 0.3
        ref = reference(mod, x)
        # the int32 accumulation is exact; only the final fp32 rescale and the reference's own fp32 sum round
        torch.testing.assert_close(mod(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        xb = x.to(torch.bfloat16)
        ref = reference(mod, xb)
        torch.testing.assert_close(mod(xb).float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_quantized_model_on_cuda_runs_its_kernels():
    """quantize_ on a bf16 model on CUDA: every block linear runs the CUDA int4 kernel, and the logits
    keep the CPU test's W4A16 signal-to-noise floor against the fp32 model (tests/quant/test_api.py)."""
    from polybasic.quant.api import quantize_
    from tests.helpers import lean_from_hf, tiny_hf_llama
    from tests.quant.test_api import IDS, W4A16, logits, snr_db

    base = lean_from_hf(tiny_hf_llama(init_std=0.1)).cuda()
    ids = IDS.cuda()
    ref = logits(base, ids)
    model = quantize_(lean_from_hf(tiny_hf_llama(init_std=0.1)).to("cuda", torch.bfloat16), W4A16)
    packed = [m for m in model.modules() if isinstance(m, Int4PackLinear)]
    assert packed and all(m.packed.is_cuda and m._mm is torch.ops.aten._weight_int4pack_mm for m in packed)
    assert snr_db(ref, logits(model, ids).float()) > 10.0
