"""Data sources in recipes: `data: PATH` or a mapping, paths relative to the recipe's folder."""
import json
from pathlib import Path

import pytest
import yaml

from polybasic.config import Recipe, dump_recipe, from_dict, load_recipe, shipped_recipes
from polybasic.data import DEFAULT_DATA, DataSource
from polybasic.data.catalog import SHIPPED, SPEC_BENCH, shipped_path
from polybasic.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, recipe: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_data_is_a_path_or_a_mapping():
    r = from_dict(Recipe, {"quantize": {"data": "a.jsonl"},
                           "distill": {"data": {"path": "o/n", "split": "train[:10]", "config": "c",
                                                "fields": {"instruction": "prompt"}}}})
    assert r.quantize.data == DataSource("a.jsonl")
    assert r.distill.data == DataSource("o/n", "train[:10]", "c", {"instruction": "prompt"})
    with pytest.raises(ConfigError, match=r"distill\.data\.fields: expected a mapping"):
        from_dict(Recipe, {"distill": {"data": {"path": "a.json", "fields": ["prompt"]}}})
    with pytest.raises(ConfigError, match=r"quantize\.data\.fields\.output: expected str"):
        from_dict(Recipe, {"quantize": {"data": {"path": "a.json", "fields": {"output": 3}}}})
    with pytest.raises(ConfigError, match=r"quantize\.data: unknown field\(s\) \['splits'\]"):
        from_dict(Recipe, {"quantize": {"data": {"path": "a.json", "splits": "train"}}})
    with pytest.raises(ConfigError, match=r"quantize\.data\.path: expected str"):
        from_dict(Recipe, {"quantize": {"data": 5}})
    with pytest.raises(ConfigError, match=r"distill\.data: .*Spec-Bench"):
        from_dict(Recipe, {"distill": {"data": {"path": "spec-bench"}}})


def test_relative_data_paths_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.jsonl").write_text('{"text": "w1"}\n')
    (tmp_path / "sub" / "local" / "name").mkdir(parents=True)  # a folder shadows a Hub id
    path = _write(tmp_path / "sub" / "r.yaml", {
        "out_dir": "runs/x", "quantize": {"data": "data.jsonl"},
        "distill": {"data": {"path": "someone/name", "split": "test"}, "quantized": "../q/model.safetensors"}})
    monkeypatch.chdir(tmp_path / "sub" / "local")  # anywhere but the recipe's folder
    r = load_recipe(Path("..") / "r.yaml")
    assert r.quantize.data == DataSource(str(tmp_path / "sub" / "data.jsonl"))
    assert r.distill.data == DataSource("someone/name", "test")  # no such path: a Hub id, untouched
    assert r.distill.quantized == str(tmp_path / "q" / "model.safetensors")
    assert r.out_dir == "runs/x"  # outputs stay relative to the current directory
    _write(path, {"quantize": {"data": "local/name"}, "distill": {"data": "/abs/d.json"}})
    r = load_recipe(path)
    assert r.quantize.data.path == str(tmp_path / "sub" / "local" / "name")
    assert r.distill.data.path == "/abs/d.json" and r.distill.quantized == ""
    # the resolved recipe saved beside the outputs loads back to the same sources from anywhere
    dump_recipe(r, tmp_path / "out" / "recipe.yaml")
    assert load_recipe(tmp_path / "out" / "recipe.yaml").quantize.data == r.quantize.data


def test_defaults_find_the_shipped_data_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_recipe(_write(tmp_path / "r.yaml", {"name": "x"}))
    assert r.quantize.data.path == r.distill.data.path == DEFAULT_DATA == "alpaca-1000"
    path = r.distill.data.local_path()
    assert path.is_file() and path == shipped_path("alpaca-1000") and path.is_relative_to(REPO / "polybasic")
    assert len(json.loads(path.read_text())) == 1000


@pytest.mark.parametrize("name", sorted(shipped_recipes()))
def test_shipped_recipes_name_the_shipped_data(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_recipe(name)  # by name, from a folder that is not the checkout
    for data in (r.quantize.data, r.distill.data, r.profile.data):  # a shipped set, found in the package
        assert data.path in SHIPPED and data.path != SPEC_BENCH and data.local_path() == shipped_path(data.path)
        assert data.local_path().is_file()
