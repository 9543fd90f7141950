"""experiments.w4a8_kernel: the W4A8 CPU kernel computes what its layout and arithmetic say, on every path."""
import os
import shutil

import pytest
import torch

from experiments import w4a8_kernel as wk

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")


@pytest.fixture(scope="module")
def ops():
    wk.build()
    return torch.ops.polybasic_w4a8


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (64, 576)])
def test_kernel_equals_its_float64_reference(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    u = torch.randint(0, 16, (n, k), generator=g)
    s = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    o = -8 * s + torch.randn(n, k // 32, generator=g) * 1e-3
    packed = wk.pack(u, s, o)
    paths = [True] + ([False] if ops.vnni() else [])  # the plain loops everywhere, VNNI where the CPU has it
    for m in (1, 2, 3, 4, 5, 9):  # 4-row blocks and their remainders
        x = torch.randn(m, k, generator=g)
        x[0, :32] = 0  # an all-zero activation group (scale 0)
        ref, mags = wk.reference(x, u, s, o)
        for plain in paths:
            y = ops.mm(x, packed, plain)
            assert y.shape == (m, n) and y.dtype == x.dtype
            assert ((y.double() - ref).abs() <= 1e-5 * mags + 1e-6).all(), (m, plain)
        assert ops.mm(x.bfloat16(), packed).dtype == torch.bfloat16


def test_layout_places_each_code_where_the_kernel_reads_it():
    n, k = 16, 64
    u = (torch.arange(n * k) % 16).view(n, k)
    packed = wk.pack(u, torch.ones(n, k // 32), torch.zeros(n, k // 32))  # [1, 2, 320]
    for row, col in [(0, 0), (3, 5), (15, 31), (7, 48), (9, 63)]:
        g, c = divmod(col, 32)
        half, r = divmod(c, 16)
        byte = packed[0, g, (r // 4) * 64 + 4 * row + r % 4]
        assert int((byte >> (4 * half)) & 15) == int(u[row, col])
    assert packed[0, 0, 256:288].view(torch.float16).tolist() == [1.0] * 16


def test_wrong_shapes_are_refused(ops):
    packed = wk.pack(torch.zeros(16, 64, dtype=torch.long), torch.ones(16, 2), torch.zeros(16, 2))
    with pytest.raises(RuntimeError, match="columns"):
        ops.mm(torch.randn(1, 32), packed)


def test_driver_prints_a_row_per_m(capsys):
    wk.main(["--hidden", "64", "--inter", "128", "--kv", "32", "--vocab", "256", "--layers", "1", "--tokens", "1,3",
             "--reps", "1", "--ceiling-mib", "16"])
    out = capsys.readouterr().out
    assert "| 1 |" in out and "| 3 |" in out and "read ceiling" in out
