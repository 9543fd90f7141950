"""Where a stage's records come from: a typed recipe field, and recipe-relative path resolution."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from polybasic.data.catalog import ALPACA, SHIPPED, SPEC_BENCH, local_or_shipped, shipped_path
from polybasic.errors import ConfigError, check

DEFAULT_DATA = ALPACA  # the shipped Alpaca subset, by its short name (polybasic.data.catalog)
FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
OUR_FIELDS = ("instruction", "input", "output", "conversations", "text")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(path: str) -> bool:
    """`owner/name` without a data-file suffix (only meaningful when no such local path exists)."""
    return bool(_HUB_ID.fullmatch(path)) and not path.lower().endswith(FILE_SUFFIXES)


@dataclass
class DataSource:
    """Records for a stage. In a recipe, `data: PATH` is short for `data: {path: PATH}`.

    path: the short name of a data set polybasic ships (`alpaca-1000`, see polybasic.data.catalog),
      a local .json (a list of records), .jsonl (one record per line), .parquet or .csv file, a
      folder of such files, or a Hugging Face Hub dataset id `owner/name` (read with
      `datasets.load_dataset` through the HF cache; offline, HF_HUB_OFFLINE=1, it must have been
      loaded once before). A relative path written in a recipe is relative to the recipe file's
      folder, not to the current directory; a short name or an id counts only when no such local
      path exists.
    split: the split to read, with datasets' slice syntax (`train`, `test`, `train[:1000]`,
      `train[90%:]`); a local file has a single split, `train`.
    config: the Hub dataset's configuration name ('' = its default).
    fields: our field name -> the dataset's column name, for datasets whose columns are named
      otherwise, e.g. {instruction: prompt, output: response} or {conversations: messages}.
      Our names: instruction, input, output (Alpaca), conversations (ShareGPT), text.
    """

    SHORTHAND: ClassVar[str] = "path"  # serde: a plain string in YAML fills this field

    path: str
    split: str = "train"
    config: str = ""
    fields: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(bool(self.path.strip()), "path", "is empty", "name a data file or a Hub dataset id owner/name")
        check(bool(self.split.strip()), "split", "is empty", "use e.g. train or train[:1000]")
        for ours, theirs in self.fields.items():
            check(ours in OUR_FIELDS, f"fields.{ours}", "is not one of our fields",
                  f"map one of {', '.join(OUR_FIELDS)} to a column name")
            check(bool(theirs), f"fields.{ours}", "is empty", "name the dataset's column")

    def __str__(self) -> str:
        """The path, plus split / config / fields when not the defaults (used in reports and errors)."""
        extra = []
        if self.split != "train":
            extra.append(f"split {self.split}")
        if self.config:
            extra.append(f"config {self.config}")
        if self.fields:
            extra.append(f"fields {self.fields}")
        return self.path + (f" ({', '.join(extra)})" if extra else "")

    def resolved(self, base: Path) -> DataSource:
        """This source with a relative local path made absolute against `base` (short names of
        shipped data and Hub ids stay as written)."""
        local = base / Path(self.path).expanduser()
        if not local.exists() and (self.path in SHIPPED or is_hub_id(self.path)):
            return self
        return replace(self, path=resolve_path(self.path, base))

    def local_path(self) -> Path:
        """The file or folder to read: a shipped data set's package file, else the path as written."""
        return local_or_shipped(self.path)

    def check_not_benchmark(self, field: str) -> None:
        """A cheap check before any reading: the shipped benchmark, by name, is never training data
        (the content check, polybasic.data.guard, runs when the records are read)."""
        if self.path == SPEC_BENCH or self.local_path().resolve() == shipped_path(SPEC_BENCH).resolve():
            raise ConfigError(f"{field}: points at the Spec-Bench questions; never train, calibrate or "
                              f"profile on the benchmark: use other prompts, e.g. {field}: {ALPACA}")


def resolve_path(path: str, base: Path) -> str:
    """`path` made absolute against `base` when relative ('~' expanded; '..' folded as text, so a
    symlinked folder keeps its name in messages)."""
    return os.path.abspath(base / Path(path).expanduser())
