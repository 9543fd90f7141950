"""The data sets polybasic ships as package data, by short name (`data: alpaca-1000`, questions
`spec-bench`), so recipes and defaults work after `pip install` with no checkout beside them.

| name        | file                                        | license                            |
|-------------|---------------------------------------------|------------------------------------|
| alpaca-1000 | files/alpaca_1000/alpaca_data_cleaned_1000.json | CC BY-NC 4.0 (NOTICE.md beside it) |
| spec-bench  | files/spec_bench/question.jsonl             | Apache-2.0 (LICENSE beside it)     |
| work-mix-48 | files/work_mix/work_mix_48.json             | Apache-2.0 (NOTICE.md beside it)   |
| code-math-640 | files/code_math/code_math_640.json        | Apache-2.0 and PSF-2.0 (NOTICE.md beside it) |
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

SHIPPED = {
    "alpaca-1000": "alpaca_1000/alpaca_data_cleaned_1000.json",  # drafter prompts, calibration, profiling
    "spec-bench": "spec_bench/question.jsonl",  # the speed benchmark: never train on it
    "work-mix-48": "work_mix/work_mix_48.json",  # code, math and prose prompts: a profile's acceptance prompts
    "code-math-640": "code_math/code_math_640.json",  # programming and math prompts for self-distillation
}
ALPACA = "alpaca-1000"
SPEC_BENCH = "spec-bench"


def shipped_path(name: str) -> Path:
    """The file of the shipped data set `name` (a key of SHIPPED)."""
    return Path(str(files("polybasic.data") / "files" / SHIPPED[name]))


def local_or_shipped(name: str | Path) -> Path:
    """The path `name` names: a shipped data set's package file for its short name, unless a local
    file or folder of that name exists (a local path always wins); '~' expanded."""
    p = Path(name).expanduser()
    return shipped_path(str(name)) if str(name) in SHIPPED and not p.exists() else p
