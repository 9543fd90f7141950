"""The record schemas every stage accepts, one validator for all of them.

Alpaca {"instruction", "input" (optional), "output" (optional: prompt-only records)}, ShareGPT
{"conversations": [{"from", "value"} or {"role", "content"}, ...]} and plain {"text"}. Other keys
are ignored. A record of none of these is rejected with the file, its line or record number and
the expected schemas, before any model loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from polybasic.data.guard import refuse_benchmark
from polybasic.data.records import Records, read_records
from polybasic.data.source import DataSource
from polybasic.errors import ConfigError

SCHEMAS = ('Alpaca {"instruction": str, "input": str (optional), "output": str}, '
           'ShareGPT {"conversations": [{"from": "human" | "gpt" | "system", "value": str} (or role / content), '
           '...]}, '
           'or {"text": str} (other column names: map them with the data source\'s fields)')
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Example:
    """One validated record: chat turns (Alpaca, ShareGPT) or plain text."""

    turns: tuple[tuple[str, str], ...] = ()  # (role, content); role: user / assistant / system
    text: str | None = None  # a plain-text record (then turns is empty)

    def exchange(self) -> tuple[str, str | None] | None:
        """(the first user turn, the assistant reply right after it or None); None without a user turn."""
        for j, (role, content) in enumerate(self.turns):
            if role == "user":
                nxt = self.turns[j + 1] if j + 1 < len(self.turns) else None
                return content, nxt[1] if nxt is not None and nxt[0] == "assistant" else None
        return None

    def messages(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.turns]


def parse_record(rec) -> Example | str:
    """The record as an Example, or why it fits none of the schemas."""
    if not isinstance(rec, dict):
        return f"it is a {type(rec).__name__}, not an object"
    present = {k: v for k, v in rec.items() if v is not None}  # columnar files fill absent fields with null
    if "conversations" in present:
        return _sharegpt(present["conversations"])
    if "instruction" in present:
        return _alpaca(present)
    if "text" in present:
        return Example(text=present["text"]) if isinstance(present["text"], str) else "text is not a string"
    return "it has none of the fields instruction / conversations / text"


def _alpaca(rec: dict) -> Example | str:
    bad = [k for k in ("instruction", "input", "output") if k in rec and not isinstance(rec[k], str)]
    if bad:
        return f"{bad[0]} is not a string (got {type(rec[bad[0]]).__name__})"
    user = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
    return Example((("user", user),) + ((("assistant", rec["output"]),) if "output" in rec else ()))


def _sharegpt(conv) -> Example | str:
    if not isinstance(conv, list) or not conv:
        return "conversations is not a non-empty list of turns"
    turns = []
    for j, t in enumerate(conv):
        role, content = (t.get("from", t.get("role")), t.get("value", t.get("content"))) \
            if isinstance(t, dict) else (None, None)
        if role not in ROLES or not isinstance(content, str):
            return (f"conversations[{j}] is not a turn {{\"from\": {' | '.join(ROLES)}, \"value\": str}} "
                    f"(got {str(t)[:60]!r})")
        turns.append((ROLES[role], content))
    return Example(tuple(turns))


def validate(recs: Records, field: str, need_prompt: bool) -> list[Example]:
    """Every record as an Example; a clear error at the first one that fits no schema (or, when
    need_prompt, that has no user turn: plain text gives a stage nothing to answer)."""
    if not recs.rows:
        raise ConfigError(f"{field}: {recs.source} holds no records; expected {SCHEMAS}")
    out = []
    for i, rec in enumerate(recs.rows):
        ex = parse_record(rec)
        if isinstance(ex, str):
            raise ConfigError(f"{field}: {recs.where(i)} of {recs.source} fits no record schema: {ex} "
                              f"(got {str(rec)[:80]!r}); expected {SCHEMAS}")
        if need_prompt and ex.exchange() is None:
            kind = "plain {text}" if ex.text is not None else "a conversation without a user turn"
            raise ConfigError(f"{field}: {recs.where(i)} of {recs.source} is {kind}, which gives no prompt; "
                              f"this stage needs prompts: Alpaca or ShareGPT records ({SCHEMAS})")
        out.append(ex)
    return out


def read_examples(src: DataSource, field: str, need_prompt: bool = False, limit: int | None = None) -> list[Example]:
    """The first `limit` records of `src`, read and validated (see `read_records`, `validate`). These
    are training, calibration or profiling records: data holding a Spec-Bench question is refused."""
    src.check_not_benchmark(field)
    recs = read_records(src, field)
    refuse_benchmark(recs.rows, recs.source, field)
    lines = None if recs.lines is None else recs.lines[:limit]
    return validate(Records(recs.source, recs.rows[:limit], lines), field, need_prompt)
