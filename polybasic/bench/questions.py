"""Spec-Bench questions: locate, load, validate, and pick a deterministic subset."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from polybasic.data.catalog import SPEC_BENCH, local_or_shipped
from polybasic.errors import ConfigError

DEFAULT_QUESTIONS = SPEC_BENCH  # the shipped Spec-Bench questions, by short name (polybasic.data.catalog)
SCHEMA = '{"question_id", "category", "turns": [...]}'
UNCATEGORIZED = "uncategorized"  # the category of questions whose category is missing, empty or null


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    prompt: str  # first turn only


def questions_path(name: str | Path | None) -> Path:
    """The question file: a shipped data set's short name (default `spec-bench`) or a path."""
    return local_or_shipped(DEFAULT_QUESTIONS if name is None or str(name) == "" else name)


def load_questions(path: str | Path | None = None) -> list[Question]:
    """Read a Spec-Bench style JSON-lines file; every error names the line and the expected schema.

    `question_id` and a non-empty `turns` list are required. `category` may be missing, empty or
    null, as in public question sets without categories: those questions form one category,
    UNCATEGORIZED ("uncategorized"); the bench then reports that single category.
    """
    p = questions_path(path)
    if not p.is_file():
        raise ConfigError(f"questions: file {p} does not exist; pass {SPEC_BENCH} or a JSON-lines file "
                          f"with one {SCHEMA} object per line")
    out: list[Question] = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"questions: {p} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON ({e.msg}); expected one {SCHEMA} object "
                              "per line") from None
        if not isinstance(obj, dict) or not {"question_id", "turns"} <= obj.keys():
            raise ConfigError(f"{where} lacks a field; expected {SCHEMA}")
        turns, cat = obj["turns"], obj.get("category") or UNCATEGORIZED
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip()):
            raise ConfigError(f"{where}: 'turns' must be a non-empty list of strings; expected {SCHEMA}")
        if not isinstance(cat, str):
            raise ConfigError(f"{where}: 'category' must be a string (or missing); expected {SCHEMA}")
        out.append(Question(obj["question_id"], cat, turns[0]))
    if not out:
        raise ConfigError(f"questions: {p} holds no questions; expected one {SCHEMA} object per line")
    return out


def select(questions: list[Question], per_category: int | None = None,
           categories: list[str] | None = None) -> list[Question]:
    """The first `per_category` questions of each category (file order), categories in file order.

    Deterministic: the same file and arguments always give the same prompts in the same order.
    """
    present = list(dict.fromkeys(q.category for q in questions))
    if categories:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise ConfigError(f"categories: unknown {', '.join(unknown)}; the file has "
                              f"{', '.join(present)}")
        present = [c for c in present if c in categories]
    if per_category is not None and per_category <= 0:
        raise ConfigError(f"per_category: must be a positive integer, got {per_category}; "
                          "omit it to use every question")
    picked: list[Question] = []
    for cat in present:
        picked.extend([q for q in questions if q.category == cat][:per_category])
    return picked
