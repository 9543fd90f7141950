"""One record reader: json / jsonl / parquet / csv / Hub ids, field mapping, splits, schemas, errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from polybasic.data import DataSource, read_examples, read_records
from polybasic.data.schema import Example
from polybasic.errors import ConfigError, DataNotFoundError

ROWS = [{"instruction": f"w{i} w{i + 1}", "input": f"w{i + 2}", "output": f"w{i + 3} {i}"} for i in range(5)]


def write_all(tmp_path, rows, stem="d"):
    """The same rows as .json, .jsonl, .parquet and .csv files."""
    import datasets

    paths = {s: tmp_path / f"{stem}.{s}" for s in ("json", "jsonl", "parquet", "csv")}
    paths["json"].write_text(json.dumps(rows))
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    return paths


def test_every_format_reads_the_same_records(tmp_path, hf_cache):
    for fmt, p in write_all(tmp_path, ROWS).items():
        assert read_records(DataSource(str(p)), "quantize.data").rows == ROWS, fmt
    assert hf_cache.is_dir()  # parquet / csv went through datasets.load_dataset


def test_csv_cells_stay_text(tmp_path, hf_cache):
    p = tmp_path / "n.csv"
    p.write_text("instruction,output\nw1,42\nw2,7\n")  # pandas alone would read the answers as ints
    assert [r["output"] for r in read_records(DataSource(str(p)), "f").rows] == ["42", "7"]


def test_field_mapping(tmp_path, hf_cache):
    rows = [{"prompt": r["instruction"], "ctx": r["input"], "response": r["output"], "id": f"r{i}"}
            for i, r in enumerate(ROWS)]
    fields = {"instruction": "prompt", "input": "ctx", "output": "response"}
    for fmt, p in write_all(tmp_path, rows).items():
        got = read_records(DataSource(str(p), fields=fields), "quantize.data").rows
        assert got == [{**r, "id": f"r{i}"} for i, r in enumerate(ROWS)], fmt
    with pytest.raises(ConfigError, match=r"distill\.data\.fields\.output: column 'answer' is not in .*d\.jsonl"
                                          r".*'response'"):
        read_records(DataSource(str(tmp_path / "d.jsonl"), fields={"output": "answer"}), "distill.data")
    with pytest.raises(ConfigError, match=r"fields\.question: is not one of our fields"):
        DataSource("x.json", fields={"question": "q"})


def test_split_slices_a_local_file(tmp_path, hf_cache):
    paths = write_all(tmp_path, ROWS)
    for fmt in ("json", "jsonl", "parquet"):
        assert read_records(DataSource(str(paths[fmt]), split="train[1:3]"), "f").rows == ROWS[1:3], fmt
        assert read_records(DataSource(str(paths[fmt]), split="train[60%:]"), "f").rows == ROWS[3:], fmt
    assert read_records(DataSource(str(paths["jsonl"]), split="train[2:]"), "f").where(0) == "line 3"
    with pytest.raises(ConfigError, match=r"quantize\.data\.split: 'test' does not apply to .*d\.json.*train"):
        read_records(DataSource(str(paths["json"]), split="test"), "quantize.data")
    with pytest.raises(ConfigError, match=r"quantize\.data: .*d\.parquet could not be read with split 'test'"):
        read_records(DataSource(str(paths["parquet"]), split="test"), "quantize.data")


def _hub_cache(tmp_path, repo_id: str) -> str:
    """A datasets cache holding `repo_id` with a train and a test split, as `load_dataset(repo_id)`
    leaves it after an online load (<cache>/<owner>___<name>/<config>/<version>/<hash>)."""
    from datasets.packaged_modules.json.json import Json

    files = {}
    for split, rows in (("train", ROWS[:3]), ("test", ROWS[3:])):
        files[split] = str(tmp_path / f"{split}.jsonl")
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    owner, name = repo_id.split("/")
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name=name, config_name="default", data_files=files)
    builder.download_and_prepare()
    cache = tmp_path / "hf-home" / "datasets"
    shutil.copytree(builder.cache_dir, cache / f"{owner}___{name}" / "default" / "0.0.0" / "0123abcd")
    return str(cache)


def test_hub_id_reads_offline_from_the_hf_cache(tmp_path):
    cache = _hub_cache(tmp_path, "someone/tiny-alpaca")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_CACHE": cache, "HF_HUB_OFFLINE": "1"}
    code = ("import json, sys; from polybasic.data import DataSource, read_records\n"
            "from polybasic.errors import PolybasicError\n"
            "for path, split in [('someone/tiny-alpaca', 'test'), ('someone/tiny-alpaca', 'train[:2]'),"
            " ('someone/not-cached', 'train')]:\n"
            "    try: print(json.dumps(read_records(DataSource(path, split=split), 'quantize.data').rows))\n"
            "    except PolybasicError as e: print('error:', e)\n")
    # cwd: a folder with no someone/ subfolder, so the id can only be a Hub id
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    test, train, missing = out.stdout.strip().splitlines()
    assert json.loads(test) == ROWS[3:] and json.loads(train) == ROWS[:2]
    assert missing.startswith("error: quantize.data: Hub dataset 'someone/not-cached' could not be read") \
        and "HF cache" in missing
    assert "Traceback" not in out.stderr


def test_unknown_schema_is_rejected_with_file_line_and_schema(tmp_path):
    p = tmp_path / "foo.jsonl"
    p.write_text("\n".join(json.dumps({"foo": i}) for i in range(3)))
    for need_prompt in (False, True):
        with pytest.raises(ConfigError, match=r"quantize\.data: line 1 of .*foo\.jsonl fits no record schema: it "
                                              r"has none of the fields.*'foo'.*Alpaca.*instruction.*ShareGPT"):
            read_examples(DataSource(str(p)), "quantize.data", need_prompt)
    q = tmp_path / "mixed.json"
    q.write_text(json.dumps([ROWS[0], {"instruction": 3}]))
    with pytest.raises(ConfigError, match=r"record 2 of .*mixed\.json fits no record schema: instruction is not a "
                                          r"string \(got int\)"):
        read_examples(DataSource(str(q)), "distill.data")
    s = tmp_path / "turns.json"
    s.write_text(json.dumps([{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}]))
    with pytest.raises(ConfigError, match=r"record 1 of .*turns\.json .*conversations\[1\] is not a turn"):
        read_examples(DataSource(str(s)), "distill.data")


def test_text_records_give_no_prompt(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"text": "w1 w2"}) + "\n")
    assert read_examples(DataSource(str(p)), "quantize.data") == [Example(text="w1 w2")]
    with pytest.raises(ConfigError, match=r"distill\.data: line 1 of .*t\.jsonl is plain \{text\}, which gives no "
                                          r"prompt; this stage needs prompts"):
        read_examples(DataSource(str(p)), "distill.data", need_prompt=True)


def test_broken_jsonl_line_is_named(tmp_path):
    p = tmp_path / "broken.jsonl"
    lines = [json.dumps(r) for r in ROWS] + ['{"instruction": "w1", "output": '] + [json.dumps(ROWS[0])]
    p.write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]))  # a blank line 3 moves the rest down
    with pytest.raises(ConfigError, match=r"quantize\.data: line 7 of .*broken\.jsonl is not valid JSON"):
        read_records(DataSource(str(p)), "quantize.data")
    p.write_text("\n".join(lines))
    with pytest.raises(ConfigError, match=r"line 6 of .*broken\.jsonl is not valid JSON \(column 33"):
        read_records(DataSource(str(p)), "quantize.data")
    j = tmp_path / "broken.json"
    j.write_text(json.dumps(ROWS, indent=1)[:-40])
    with pytest.raises(ConfigError, match=r"broken\.json is not valid JSON: line \d+ column \d+"):
        read_records(DataSource(str(j)), "quantize.data")


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(DataNotFoundError, match=r"distill\.data: .*nope\.json does not exist; fix distill\.data\.path"):
        read_records(DataSource(str(tmp_path / "nope.json")), "distill.data")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"d\.txt has an unknown suffix '\.txt'"):
        read_records(DataSource(str(tmp_path / "d.txt")), "distill.data")


def test_schemas_become_chat_turns(tmp_path):
    recs = [{"instruction": "a", "input": "b", "output": "c"}, {"instruction": "q"},
            {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                               {"from": "gpt", "value": "g"}]},
            {"conversations": [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "g2"}]}]
    p = tmp_path / "m.json"
    p.write_text(json.dumps(recs))
    ex = read_examples(DataSource(str(p)), "f", need_prompt=True)
    assert [e.turns for e in ex] == [(("user", "a\n\nb"), ("assistant", "c")), (("user", "q"),),
                                     (("system", "s"), ("user", "u"), ("assistant", "g")),
                                     (("user", "u2"), ("assistant", "g2"))]
    assert [e.exchange() for e in ex] == [("a\n\nb", "c"), ("q", None), ("u", "g"), ("u2", "g2")]
