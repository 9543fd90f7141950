"""`python -m experiments.w4a8_kernel`: torch's int4 kernel against 'w4a8' per M, beside the read ceiling."""
import os
import shutil

import pytest

from experiments import w4a8_kernel


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_driver_prints_a_row_per_m(capsys):
    w4a8_kernel.main(["--hidden", "64", "--inter", "128", "--kv", "32", "--vocab", "256", "--layers", "1",
                      "--tokens", "1,3", "--reps", "1", "--ceiling-mib", "16"])
    out = capsys.readouterr().out
    assert "| 1 |" in out and "| 3 |" in out and "read ceiling" in out and "5 linears" in out
