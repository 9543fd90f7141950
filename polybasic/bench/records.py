"""A bench run's measurements as they come: the records file, and --resume from it.

The file (DIR/records.jsonl with --report DIR, else OUT's name with .records.jsonl for --json OUT) holds
one JSON object a line:

    {"kind": "header", "format": FORMAT, "config": {every option that changes results}}
    {"kind": "compile", "method": M, "seconds": S}        a compiled method's steps ready (before its prompts)
    {"kind": "record", "method": M, "question_id": Q, "category": C, ..., "tokens": [...]}   runner.Record
    {"kind": "failure", "method": M, "reason": ..., ...}  peers.Failure: M is not run again

Each entry is appended with one os.write of the whole line, then fsync: a process killed at any point
leaves whole lines and at most one partial last line, which a reader ignores and a resumed run cuts off
before appending. (Appending keeps a write per record O(1); rewriting the file through a temp name would
rewrite every earlier record, tokens included, at each prompt.) A resumed run (`--resume`) must have the
header's config unchanged; it measures only the (method, prompt) pairs the file lacks. A run without
--resume moves an earlier run's records aside (records.<time>.jsonl) rather than overwrite them.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from polybasic.bench.peers import Failure
from polybasic.bench.runner import Record
from polybasic.errors import ConfigError, CorruptFileError

FORMAT = "polybasic.bench.records/1"
ADDED_FIELDS = {"repeat": 1}  # config fields added since the format began: the value a header without one meant
NAME = "records.jsonl"


def records_path(report: str | Path | None, json_out: str | Path | None) -> Path | None:
    """Where a run's records go: in the --report folder, else beside the --json file (None: neither)."""
    if report:
        return Path(report) / NAME
    return Path(json_out).with_suffix(".records.jsonl") if json_out else None


@dataclass
class RunLog:
    """Everything a run measured, in the order measured (a resumed run's earlier entries first); with a
    path, each new entry is also appended to the records file as it comes. The file is written from the
    first entry on: a run that fails before measuring anything leaves it as it was."""
    path: Path | None = None
    header: dict | None = None  # a fresh file's first line
    keep: int | None = None  # a resumed file: its whole lines' length in bytes (a partial last line is cut)
    records: list[Record] = field(default_factory=list)
    failures: dict[str, Failure] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)
    _fd: int | None = field(default=None, repr=False)

    def record(self, r: Record) -> None:
        self.records.append(r)
        self._append({"kind": "record", **asdict(r)})

    def failure(self, f: Failure) -> None:
        self.failures[f.method] = f
        self._append({"kind": "failure", **asdict(f)})

    def compiled(self, method: str, seconds: float) -> None:
        self.compile_s[method] = seconds
        self._append({"kind": "compile", "method": method, "seconds": seconds})

    def done(self) -> set[tuple]:
        """The (method, question_id, category) pairs measured."""
        return {(r.method, r.question_id, r.category) for r in self.records}

    def pending(self, methods: Sequence[str], prompts: Sequence[tuple]) -> list[str]:
        """The methods with a prompt left to measure (a failed one has none)."""
        done = self.done()
        return [m for m in methods if m not in self.failures and any((m, q, c) not in done for q, c, *_ in prompts)]

    def _append(self, entry: dict) -> None:
        if self.path is None:
            return
        if self._fd is None:
            self._fd = self._start()
        _write_line(self._fd, entry)

    def _start(self) -> int:
        """The file opened for appending: a resumed one after its last whole line, else a new one."""
        if self.keep is not None:
            os.truncate(self.path, self.keep)
            return os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return _create(self.path, self.header)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_line(fd: int, entry: dict) -> None:
    """One whole line in one write, made durable before returning."""
    line = (json.dumps(entry) + "\n").encode()
    if os.write(fd, line) != len(line):
        raise OSError(f"records: a short write ({len(line)} bytes wanted); is the disk full?")
    os.fsync(fd)


def read_entries(path: Path) -> tuple[list[dict], int]:
    """The file's whole lines, parsed, and their length in bytes (a partial last line, cut by a kill, left
    out). A damaged whole line raises CorruptFileError."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    entries = []
    for n, line in enumerate(data[:end].splitlines(), 1):
        try:
            entries.append(json.loads(line))
        except ValueError:
            raise CorruptFileError(f"records: {path} line {n} is not JSON; pass another --report folder, or "
                                   "drop --resume to start over (the file is then moved aside)") from None
    return entries, end


def open_log(path: Path | None, config: dict, resume: bool, restart_changed: bool = False) -> RunLog:
    """The run's log: fresh, or with --resume the records file's entries (its config must equal `config`;
    with restart_changed a changed one starts over instead). Checked before any model loads."""
    if path is None:
        if resume:
            raise ConfigError("--resume: continues the records of a --report folder or --json file; pass the "
                              "killed run's --report (or --json) as well")
        return RunLog()
    config = json.loads(json.dumps(config))  # as the file holds it (tuples as lists)
    if resume and path.is_file():
        entries, end = read_entries(path)
        changed = _changed_field(path, entries, config)
        if changed is None:
            return _continue(path, entries, end)
        if not restart_changed:
            raise ConfigError(changed)
    elif resume:
        print(f"[records: {path} does not exist; starting from the first prompt]", file=sys.stderr)
    return RunLog(path, header={"kind": "header", "format": FORMAT, "config": config})


def _changed_field(path: Path, entries: list[dict], config: dict) -> str | None:
    """None if the file's header has `config`; else the error naming the first field that differs."""
    head = entries[0] if entries else {}
    if head.get("kind") != "header" or head.get("format") != FORMAT:
        return (f"--resume: {path} is not a records file of this bench ({FORMAT}); drop --resume to start over "
                "(the file is then moved aside) or pass another --report folder")
    old = head["config"]
    for key in dict.fromkeys([*config, *old]):
        was = old.get(key, ADDED_FIELDS.get(key))
        if was != config.get(key):
            return (f"--resume: {key} changed: the records in {path} were measured with {key} = "
                    f"{was!r}, this command has {config.get(key)!r}; run the earlier command to continue "
                    "them, or drop --resume (the earlier records are then moved aside) or pass another --report "
                    "folder to start over")
    return None


def _continue(path: Path, entries: list[dict], end: int) -> RunLog:
    """A RunLog holding the file's entries, appending after its last whole line."""
    log = RunLog(path, keep=end)
    for e in entries[1:]:
        kind = e.pop("kind")
        if kind == "record":
            log.records.append(Record(**e))
        elif kind == "failure":
            log.failures[e["method"]] = Failure(**e)
        elif kind == "compile":
            log.compile_s[e["method"]] = e["seconds"]
    print(f"[records: resuming {path}: {len(log.records)} records, {len(log.failures)} failed methods]",
          file=sys.stderr)
    return log


def _create(path: Path, header: dict) -> int:
    """A new records file holding `header` (an earlier run's entries moved aside first), open for appending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and _has_entries(path):
        aside = _aside_name(path)
        os.replace(path, aside)
        print(f"[records: the earlier run's {path} moved to {aside.name}; --resume continues a killed run instead]",
              file=sys.stderr)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o666)
    _write_line(fd, header)
    _fsync_folder(path.parent)
    return fd


def _has_entries(path: Path) -> bool:
    """Anything but a bare header line (a run that measured something, or a file of another kind)."""
    data = path.read_bytes()
    first, _, rest = data.partition(b"\n")
    try:
        bare = not rest and json.loads(first).get("kind") == "header"
    except (ValueError, AttributeError):
        bare = False
    return bool(data) and not bare


def _aside_name(path: Path) -> Path:
    """records.<mtime>.jsonl beside `path`, a free name."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    n, aside = 1, path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    while aside.exists():
        n, aside = n + 1, path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
    return aside


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
