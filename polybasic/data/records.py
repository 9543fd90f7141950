"""Reading records (one dict per example) from local files or the Hugging Face Hub.

.json and .jsonl are parsed here, so that a syntax error names its real line; .parquet, .csv,
folders and Hub ids (`owner/name`) are read by `datasets.load_dataset` (imported lazily: it costs
about a second). Every error names the recipe field, the file or id, and the fix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from polybasic.data.catalog import SHIPPED
from polybasic.data.source import FILE_SUFFIXES, DataSource, is_hub_id
from polybasic.errors import ConfigError, DataNotFoundError


@dataclass(frozen=True)
class Records:
    """The rows of one source, with our field names (after `DataSource.fields`)."""

    source: str  # the file or Hub id, as errors name it
    rows: list  # one dict per record (anything else is left for the schema check to reject)
    lines: list[int] | None = None  # 1-based line of each row in a .jsonl file

    def where(self, i: int) -> str:
        """'line N' (JSONL) or 'record N' (1-based) of row i."""
        return f"line {self.lines[i]}" if self.lines is not None else f"record {i + 1}"


def read_records(src: DataSource, field: str) -> Records:
    """The records of `src`; `field` is the recipe field that named it (e.g. quantize.data)."""
    p = src.local_path()
    if p.is_file():
        suffix = p.suffix.lower()
        if suffix in (".json", ".jsonl"):
            rows, lines = (_read_jsonl if suffix == ".jsonl" else _read_json)(p, field)
            first, last = _split_range(src.split, len(rows), field, p)
            recs = Records(str(p), rows[first:last], None if lines is None else lines[first:last])
        elif suffix in (".parquet", ".csv"):
            kw = {"features": _csv_strings(p, field)} if suffix == ".csv" else {}
            recs = Records(str(p), _load_dataset(suffix[1:], src, field, str(p), data_files=str(p), **kw))
        else:
            raise ConfigError(f"{field}: {p} has an unknown suffix {suffix!r}; use a "
                              f"{' / '.join(FILE_SUFFIXES)} file, a folder of them, or a Hub dataset id")
    elif p.is_dir():
        recs = Records(str(p), _load_dataset(str(p), src, field, str(p)))
    elif is_hub_id(src.path):
        recs = Records(src.path, _load_dataset(src.path, src, field, f"Hub dataset {src.path!r}"))
    else:
        raise DataNotFoundError(f"{field}: {p} does not exist; fix {field}.path (a relative path in a recipe is "
                                f"relative to the recipe's folder), name a shipped data set "
                                f"({', '.join(SHIPPED)}) or a Hub dataset id owner/name")
    return _map_fields(recs, src.fields, field)


def _read_json(p: Path, field: str) -> tuple[list, None]:
    try:
        data = json.loads(_text(p, field))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{field}: {p} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, list):
        raise ConfigError(f"{field}: {p} holds a JSON {type(data).__name__}, not a list of records; "
                          "use a list [{...}, ...] or a .jsonl file with one record per line")
    return data, None


def _read_jsonl(p: Path, field: str) -> tuple[list, list[int]]:
    rows, lines = [], []
    for n, line in enumerate(_text(p, field).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{field}: line {n} of {p} is not valid JSON (column {e.colno}: {e.msg}); "
                              "a .jsonl file holds one JSON object per line") from None
        lines.append(n)
    return rows, lines


def _text(p: Path, field: str) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(p, field, e) from None


def _not_utf8(p: Path, field: str, e: UnicodeDecodeError) -> ConfigError:
    return ConfigError(f"{field}: {p} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8")


def _csv_strings(p: Path, field: str):
    """Every column of a CSV file as strings (its cells have no types; '42' must stay text)."""
    import csv

    import datasets

    try:
        with p.open(encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), None)
    except UnicodeDecodeError as e:
        raise _not_utf8(p, field, e) from None
    if not header:
        raise ConfigError(f"{field}: {p} is empty; a .csv file starts with a header row of column names")
    return datasets.Features({c: datasets.Value("string") for c in header})


def _split_range(split: str, n: int, field: str, p: Path) -> tuple[int, int]:
    """[first, last) rows of a single local file's `split` (`train`, or a slice such as train[:100])."""
    if split == "train":
        return 0, n
    from datasets import ReadInstruction

    try:
        (part,) = ReadInstruction.from_spec(split).to_absolute({"train": n})
    except ValueError as e:  # an unknown split or slice
        raise ConfigError(f"{field}.split: {split!r} does not apply to {p} ({e}); a local file has one split, "
                          "train; slice it as train[:1000] or train[90%:]") from None
    return part.from_, part.to


def _load_dataset(path: str, src: DataSource, field: str, what: str, **kw) -> list[dict]:
    """Rows of `datasets.load_dataset(path, ...)`; any failure becomes our error naming `what`."""
    import datasets

    try:
        ds = datasets.load_dataset(path, src.config or None, split=src.split, **kw)
    except Exception as e:  # datasets raises many types; the user needs the one line that says why
        why = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {why[0] if why else ''}"
        hub = (" (a Hub id is read through the HF cache; offline, HF_HUB_OFFLINE=1, it must have been loaded "
               "once while online)") if is_hub_id(path) else ""
        raise ConfigError(f"{field}: {what} could not be read with split {src.split!r}"
                          f"{f' and config {src.config!r}' if src.config else ''}: {reason}; "
                          f"check {field}.path / split / config{hub}") from None
    return ds.to_list()


def _map_fields(recs: Records, fields: dict[str, str], field: str) -> Records:
    """Rename the dataset's columns to our names (`fields`: ours -> theirs)."""
    if not fields:
        return recs
    columns = {k for r in recs.rows if isinstance(r, dict) for k in r}
    for ours, theirs in fields.items():
        if theirs not in columns:
            raise ConfigError(f"{field}.fields.{ours}: column {theirs!r} is not in {recs.source} "
                              f"(columns: {sorted(columns)}); name one of those")
    theirs = set(fields.values())
    rows = [{**{k: v for k, v in r.items() if k not in theirs}, **{o: r[t] for o, t in fields.items() if t in r}}
            if isinstance(r, dict) else r for r in recs.rows]
    return Records(recs.source, rows, recs.lines)
