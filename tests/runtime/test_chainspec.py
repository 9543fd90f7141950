"""Typed chain specs: parsing, the JSON form, every grammar error, and the file checks (no torch)."""
import json
import subprocess
import sys

import pytest

from polybasic._lazy import load_entry
from polybasic.errors import ConfigError, CorruptFileError, ModelNotFoundError
from polybasic.runtime.chainspec import (
    LEVEL_KINDS,
    ChainSpec,
    LevelSpec,
    check_chain_files,
    parse_chain_spec,
    parse_level_spec,
)
from tests.damaged import write_weight_files


def test_parse_every_kind():
    spec = parse_chain_spec("target+target@bf16+m.safetensors+eagle:h.safetensors+ngram:2")
    assert spec.levels == (LevelSpec("target", dtype="bf16", name="target@bf16"),
                           LevelSpec("quantized", path="m.safetensors", name="m.safetensors"),
                           LevelSpec("eagle", path="h.safetensors", name="eagle:h.safetensors"),
                           LevelSpec("ngram", max_ngram=2, name="ngram:2"))
    assert parse_level_spec(" owner/model@fp16 ") == LevelSpec("model", source="owner/model", dtype="fp16",
                                                               name="owner/model@fp16")
    assert parse_level_spec("runs/a@b/folder") == LevelSpec("model", source="runs/a@b/folder",
                                                            name="runs/a@b/folder")  # '@' in a path
    assert parse_level_spec("ngram").max_ngram == 3 and parse_level_spec("target").dtype == "float32"
    assert parse_chain_spec("eagle:h.safetensors").spelling == "eagle:h.safetensors"  # the target is above
    q = parse_level_spec("runs/a@b/m.safetensors@w4a8")  # a kernel after the path; '@' inside the path kept
    assert q == LevelSpec("quantized", path="runs/a@b/m.safetensors", kernel="w4a8", name="runs/a@b/m.safetensors@w4a8")
    assert LevelSpec.from_dict(q.to_dict()) == q and LevelSpec("quantized", path="m.safetensors", kernel="w4a8").name \
        == "m.safetensors@w4a8"
    assert LevelSpec.from_dict({"kind": "quantized", "path": "m.safetensors"}).kernel == ""  # a bundle before kernels


def test_dict_round_trip_and_form():
    spec = parse_chain_spec("target@bf16+m.safetensors+eagle:h.safetensors+smollm2-135m+ngram")
    d = spec.to_dict()
    assert ChainSpec.from_dict(json.loads(json.dumps(d))) == spec
    assert d["version"] == 1 and d["levels"][0] == {"kind": "target", "dtype": "bf16", "name": "target@bf16"}
    assert d["levels"][3] == {"kind": "model", "source": "smollm2-135m", "dtype": "float32",
                              "name": "smollm2-135m"}
    assert d["levels"][4] == {"kind": "ngram", "max_ngram": 3, "tree_width": 1, "name": "ngram"}
    assert LevelSpec("ngram", max_ngram=4).name == "ngram:4"  # a spec built in code gets its spelling
    assert ChainSpec.from_dict({"levels": [{"kind": "eagle", "path": "h.safetensors"}]}).spelling == \
        "eagle:h.safetensors"


@pytest.mark.parametrize("text, item, words", [
    ("", "''", "empty level name"),
    ("ngram+", "'ngram+'", "empty level name"),
    ("ngram++target@bf16", "'ngram++target@bf16'", "empty level name"),
    ("target", "'target'", "names no level below the target"),
    ("ngram:x", "level 'ngram:x'", "integer n-gram size"),
    ("ngram:0", "level 'ngram:0'", "max_ngram must be an integer >= 1"),
    ("eagle:", "level 'eagle:'", "needs a file path"),
    ("target@fp8", "level 'target@fp8'", "unknown dtype 'fp8'"),
    ("smollm2-135m@int3", "level 'smollm2-135m@int3'", "unknown dtype 'int3'"),
    ("m.safetensors@bf16", "level 'm.safetensors@bf16'", "unknown kernel 'bf16'"),
    ("ngram+eagle:h.safetensors", "'eagle:h.safetensors'", "not a model"),
    ("target@bf16+eagle:a.safetensors+eagle:b.safetensors", "'eagle:b.safetensors'", "not a model"),
])
def test_grammar_errors_name_the_flag_and_item(text, item, words):
    with pytest.raises(ConfigError) as e:
        parse_chain_spec(text, "--chain")
    msg = str(e.value)
    assert msg.startswith("--chain") and item in msg and words in msg, msg


@pytest.mark.parametrize("d, words", [
    ({"levels": [{"kind": "beam"}]}, "unknown level kind 'beam'"),
    ({"levels": [{"kind": "ngram", "path": "x"}]}, "unknown fields ['path']"),
    ({"levels": []}, "names no level"),
    ({"version": 9, "levels": [{"kind": "ngram"}]}, "version 9"),
    ({"levels": "ngram"}, "expected {'version'"),
    ({"levels": ["ngram"]}, "a level must be an object"),
    ({"levels": [{"kind": "ngram", "max_ngram": "3"}]}, "max_ngram must be"),
])
def test_from_dict_errors(d, words):
    with pytest.raises(ConfigError, match="^manifest chain: ") as e:
        ChainSpec.from_dict(d, "manifest chain")
    assert words in str(e.value)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model folder, a quantized copy and a head, each also damaged (random bytes, truncated)."""
    d = write_weight_files(tmp_path_factory.mktemp("spec_files"), hidden=48)
    (d / "nometa.safetensors").write_bytes((d / "h.safetensors").read_bytes().replace(b"drafter_config",
                                                                                     b"drafter_xxxxxx"))
    (d / "empty_folder").mkdir()
    return d


def test_check_files_accepts_good_files(files):
    spec = parse_chain_spec(f"{files / 'm'}@bf16+{files / 'q.safetensors'}+eagle:{files / 'h.safetensors'}")
    assert check_chain_files(spec) is spec


@pytest.mark.parametrize("item, error, words", [
    ("foo", ModelNotFoundError, "'foo' is not a known name"),
    ("{d}/missing", ModelNotFoundError, "is not a known name"),
    ("{d}/empty_folder", ModelNotFoundError, "has no config.json"),
    ("{d}/missing.gguf", ModelNotFoundError, "does not exist"),
    ("{d}/missing.safetensors", ModelNotFoundError, "does not exist"),
    ("{d}/q_trunc.safetensors", CorruptFileError, "truncated: its header says the file has"),
    ("{d}/q_rand.safetensors", CorruptFileError, "not a safetensors file"),
    ("{d}/h.safetensors", ConfigError, "not a polybasic quantized copy"),
    ("eagle:{d}/missing.safetensors", ConfigError, "does not exist"),
    ("eagle:{d}/h_trunc.safetensors", CorruptFileError, "polybasic distill"),
    ("eagle:{d}/h_rand.safetensors", CorruptFileError, "not a safetensors file"),
    ("eagle:{d}/nometa.safetensors", ConfigError, "no drafter_config metadata"),
])
def test_check_files_errors_name_flag_item_and_problem(files, item, error, words):
    item = item.format(d=files)
    spec = parse_chain_spec(item)  # pure: parsing reads no file
    with pytest.raises(error) as e:
        check_chain_files(spec, "--methods chain:x")
    msg = str(e.value)
    assert msg.startswith(f"--methods chain:x: level '{item}'") and words in msg, msg


def test_every_kind_has_a_builder():
    assert set(LEVEL_KINDS) == {"eagle", "ngram", "quantized", "target", "model"}
    for kind in LEVEL_KINDS.values():
        assert callable(load_entry(kind.builder)), kind.name


def test_parsing_and_checking_import_no_torch(files):
    code = ("import sys; from polybasic.runtime.chainspec import parse_chain_spec, check_chain_files; "
            f"check_chain_files(parse_chain_spec('target@bf16+{files / 'q.safetensors'}+eagle:{files / 'h.safetensors'}"
            f"+{files / 'm'}+ngram')); "
            "print([m for m in ('torch', 'transformers', 'lightning') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
