"""`python -m experiments.bf16_rows_kernel`: oneDNN against 'bf16_rows' per M, beside the read ceiling."""
import pytest

from experiments import bf16_rows_kernel
from polybasic.models import bf16_rows


def test_driver_prints_a_row_per_m(capsys):
    if not bf16_rows.status()[0]:
        pytest.skip(f"the bf16_rows kernel cannot run here: {bf16_rows.status()[1]}")
    bf16_rows_kernel.main(["--hidden", "64", "--inter", "128", "--kv", "32", "--vocab", "256", "--layers", "1",
                           "--tokens", "1,3", "--reps", "1", "--ceiling-mib", "16"])
    out = capsys.readouterr().out
    assert "| 1 |" in out and "| 3 |" in out and "read ceiling" in out and "5 linears" in out
