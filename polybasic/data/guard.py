"""Keeps the benchmark out of training: data whose text contains a Spec-Bench question is refused.

The check compares content, not paths: every string in a record (Alpaca fields, ShareGPT turns, plain
text, and the Alpaca instruction joined with its input, as stages read it) is normalised (whitespace
collapsed) and hashed, and a hash equal to that of any Spec-Bench turn refuses the data, whatever the
file is called or wherever it lives.
"""
from __future__ import annotations

import functools
import hashlib
import json

from polybasic.data.catalog import SPEC_BENCH, shipped_path
from polybasic.errors import ConfigError


def text_hash(text: str) -> str:
    """sha256 of `text` with runs of whitespace collapsed to one space and the ends stripped."""
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()


@functools.cache
def benchmark_hashes() -> frozenset[str]:
    """The text hashes of every turn of the shipped Spec-Bench questions."""
    lines = shipped_path(SPEC_BENCH).read_text(encoding="utf-8").splitlines()
    return frozenset(text_hash(t) for line in lines if line.strip() for t in json.loads(line)["turns"])


def _strings(value) -> list[str]:
    """Every string inside a record value (nested lists and mappings included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def record_texts(rec) -> list[str]:
    """The texts of one record a stage could read: its strings, and instruction + input as one prompt."""
    texts = _strings(rec)
    if isinstance(rec, dict) and isinstance(rec.get("instruction"), str) and isinstance(rec.get("input"), str):
        texts.append(f"{rec['instruction']}\n\n{rec['input']}")
    return texts


def refuse_benchmark(rows: list, source: str, field: str) -> None:
    """ConfigError naming `field` if any row of `source` holds the text of a Spec-Bench question."""
    bench = benchmark_hashes()
    hits = [i for i, rec in enumerate(rows) if any(text_hash(t) in bench for t in record_texts(rec))]
    if hits:
        raise ConfigError(f"{field}: {source} holds {len(hits)} Spec-Bench question(s) (first: record "
                          f"{hits[0] + 1}); never train, calibrate or profile on the benchmark: use other "
                          f"prompts, e.g. {field}: alpaca-1000")
