"""Data sources in recipes: `data: PATH` or a mapping, paths relative to the recipe's folder."""
from pathlib import Path

import pytest
import yaml

from polybasic.data import DEFAULT_DATA, DataSource
from polybasic.errors import ConfigError
from polybasic.pipelines.recipe import Recipe, dump_recipe, from_dict, load_recipe

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
        from_dict(Recipe, {"distill": {"data": {"path": "../shared/data/spec_bench/question.jsonl"}}})


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


def test_defaults_find_the_bundled_data_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_recipe(_write(tmp_path / "r.yaml", {"name": "x"}))
    assert r.quantize.data.path == r.distill.data.path == DEFAULT_DATA
    assert Path(DEFAULT_DATA).is_absolute()
    assert DEFAULT_DATA == str((REPO / "../shared/data/alpaca_1000/alpaca_data_cleaned_1000.json").resolve())


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_point_at_the_bundled_data(name, tmp_path, monkeypatch):
    if not Path(DEFAULT_DATA).is_file():
        pytest.skip("shared data not present")
    monkeypatch.chdir(tmp_path)
    r = load_recipe(REPO / "recipes" / name)
    # the same file (shared/ may be reached through a symbolic link beside the checkout)
    for data in (r.quantize.data, r.distill.data, r.profile.data):
        assert Path(data.path).resolve() == Path(DEFAULT_DATA).resolve()
