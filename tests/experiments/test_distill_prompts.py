"""Self-distillation prompt sets: the shipped code-math-640 (what experiments.code_math_prompts writes) and
experiments.prose_prompts' prose mix; distinct, none a profile or benchmark prompt, every kind among the first."""
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import code_math_prompts, prose_prompts
from experiments.code_math_prompts import kept_apart
from polybasic.drafters.data import load_pairs

CODE = ("Write", "Explain", "Show", "Implement", "A colleague")


def test_shipped_code_math_reads_as_640_distinct_prompts_apart_from_profile_and_benchmark():
    prompts = [q for q, _ in load_pairs("code-math-640", field="distill.more_data[0]")]
    assert len(prompts) == len(set(prompts)) == 640
    assert sum(p.startswith(CODE) for p in prompts) >= 400
    assert not set(prompts) & kept_apart()
    assert all(p.startswith(CODE) for p in prompts[:5])


def test_the_prose_mix_holds_600_distinct_prompts_every_kind_in_its_first_round():
    prompts = [r["instruction"] for r in prose_prompts.records()]
    assert len(prompts) == len(set(prompts)) == 600 and not set(prompts) & kept_apart()
    first = prompts[:60]
    assert sum(p.startswith("You are ") for p in first) == 6 and sum(p.startswith("Write ") for p in first) >= 13
    assert any(p.startswith(("Translate", "How would you say")) for p in first)
    assert sum("\n\n" in p for p in first) == 16  # passages


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the docstrings are Python 3.11's standard library's")
def test_the_driver_writes_the_shipped_file():
    """In a fresh interpreter: pytest replaces some standard library functions (sys.unraisablehook, ...)."""
    done = subprocess.run([sys.executable, "-m", "experiments.code_math_prompts", "--check"], capture_output=True,
                          text=True, cwd=Path(code_math_prompts.__file__).parents[1])
    assert done.returncode == 0, done.stdout + done.stderr
