"""Reading record files (a JSON list, or JSON lines) with errors that name the field and schema."""
from __future__ import annotations

import json
from pathlib import Path

from polybasic.errors import ConfigError, DataNotFoundError


def read_records(path: str | Path, field: str, expected: str) -> list:
    """Records of a .json file (a list) or a .jsonl file (one object per line).

    field: the recipe field that named the file; expected: the schema, quoted in every error.
    """
    p = Path(path)
    if not p.is_file():
        raise DataNotFoundError(f"{field}: {p} does not exist; pass a JSON or JSONL file of {expected}")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{field}: {p} is not valid JSON ({e}); expected {expected}") from None
    if not isinstance(data, list):
        raise ConfigError(f"{field}: {p} holds a {type(data).__name__}, not a list; expected {expected}")
    return data
