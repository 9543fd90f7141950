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


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler")
def test_against_a_revision_times_both_kernels_and_checks_their_bits(capsys):
    """--against REV builds the kernel's source at that revision beside this one (HEAD: the same arithmetic)."""
    w4a8_kernel.main(["--hidden", "64", "--inter", "128", "--kv", "32", "--vocab", "256", "--layers", "2",
                      "--tokens", "1,9", "--reps", "1", "--ceiling-mib", "16", "--against", "HEAD"])
    out = capsys.readouterr().out
    assert "9 linears (2 on 6-bit tiles)" in out  # the LM head and layer 1's down projection
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 9 |"))]
    assert len(rows) == 2 and all(line.endswith("| True |") for line in rows)
