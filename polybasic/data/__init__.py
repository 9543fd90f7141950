"""Dataset records for every stage that reads data (quantize calibration, distill prompts).

`DataSource` (source.py) says where the records are; `read_records` (records.py) reads them from a
local .json / .jsonl / .parquet / .csv file, a folder, or a Hub dataset id; `read_examples`
(schema.py) checks them against the schemas we accept (Alpaca, ShareGPT, plain text).
"""
from polybasic.data.records import Records, read_records
from polybasic.data.schema import SCHEMAS, Example, read_examples
from polybasic.data.source import DEFAULT_DATA, DataSource, resolve_path

__all__ = ["DataSource", "DEFAULT_DATA", "resolve_path", "Records", "read_records", "Example", "SCHEMAS",
           "read_examples"]
