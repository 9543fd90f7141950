"""The shipped code-math-640 prompts: what experiments.code_math_prompts writes, distinct, none a profile or
benchmark prompt."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import code_math_prompts
from polybasic.data import catalog
from polybasic.drafters.data import load_pairs


def test_shipped_file_reads_as_640_distinct_prompts_apart_from_profile_and_benchmark():
    prompts = [q for q, _ in load_pairs("code-math-640", field="distill.more_data[0]")]
    assert len(prompts) == len(set(prompts)) == 640
    assert sum(p.startswith(("Write", "Explain", "Show", "Implement", "A colleague")) for p in prompts) >= 400
    work = {r["instruction"] for r in json.loads(catalog.shipped_path("work-mix-48").read_text())}
    bench = {t for line in catalog.shipped_path("spec-bench").read_text().splitlines() if line.strip()
             for t in json.loads(line).get("turns", [])}
    assert not set(prompts) & (work | bench)
    assert all(p.startswith(("Write", "Explain", "Show", "Implement", "A colleague")) for p in prompts[:5])


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the docstrings are Python 3.11's standard library's")
def test_the_driver_writes_the_shipped_file():
    """In a fresh interpreter: pytest replaces some standard library functions (sys.unraisablehook, ...)."""
    done = subprocess.run([sys.executable, "-m", "experiments.code_math_prompts", "--check"], capture_output=True,
                          text=True, cwd=Path(code_math_prompts.__file__).parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
