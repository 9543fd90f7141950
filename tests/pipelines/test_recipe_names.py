"""Shipped recipes by name, `polybasic recipes`, and `--set` overrides: one syntax for every recipe command."""
import pytest
import yaml

from polybasic.cli import main
from polybasic.config import apply_overrides, load_recipe, recipe_path, shipped_recipes
from polybasic.errors import ConfigError


def test_shipped_recipes_are_package_data_with_a_description():
    recipes = shipped_recipes()
    assert {"smollm2-smoke", "smollm2-quick", "qwen2.5-coder-1.5b-cpu"} <= set(recipes)
    for name, path in recipes.items():
        assert path.parent.name == "recipes" and path.parent.parent.name == "polybasic"
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.description and len(recipe.description) < 140


def test_a_recipe_is_a_path_or_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert recipe_path("smollm2-smoke") == recipe_path("smollm2-smoke.yaml") == shipped_recipes()["smollm2-smoke"]
    (tmp_path / "smollm2-smoke").write_text(yaml.safe_dump({"name": "mine"}))  # a file wins over a shipped name
    assert load_recipe("smollm2-smoke").name == "mine"
    with pytest.raises(ConfigError, match=r"recipe: nope is neither a file nor a shipped recipe.*smollm2-smoke"):
        load_recipe("nope")
    with pytest.raises(ConfigError, match="neither a file"):
        recipe_path("sub/smollm2-smoke")  # a name has no folder


def test_overrides_set_nested_fields_with_yaml_values():
    data = {"distill": {"data": "alpaca-1000", "train": {"lr": 0.001}}}
    out = apply_overrides(data, ["distill.train.lr=1e-2", "distill.limit=64", "bench.categories=[qa, rag]",
                                 "profile.temperature=0", "distill.references=false", "name=x=y"])
    assert out == {"distill": {"data": "alpaca-1000", "train": {"lr": 0.01}, "limit": 64, "references": False},
                   "bench": {"categories": ["qa", "rag"]}, "profile": {"temperature": 0}, "name": "x=y"}
    assert data["distill"]["train"]["lr"] == 0.001  # the input is left as it was
    with pytest.raises(ConfigError, match=r"--set: 'distill\.train' is not KEY=VALUE"):
        apply_overrides(data, ["distill.train"])
    with pytest.raises(ConfigError, match=r"--set: distill\.data is 'alpaca-1000', not a section"):
        apply_overrides(data, ["distill.data.split=train"])


def test_overrides_are_checked_like_the_recipe(tmp_path):
    r = load_recipe("smollm2-quick", ["distill.train.lr=1e-2", "profile.prompts=3"])
    assert r.distill.train.lr == 0.01 and r.profile.prompts == 3
    with pytest.raises(ConfigError, match=r"distill\.train: unknown field\(s\) \['lrr'\]"):
        load_recipe("smollm2-quick", ["distill.train.lrr=1"])
    with pytest.raises(ConfigError, match=r"profile\.prompts: must be an integer >= 1"):
        load_recipe("smollm2-quick", ["profile.prompts=0"])
    with pytest.raises(ConfigError, match=r"profile\.measured_k_values: must be integers >= 1, got \[2, 0\]"):
        load_recipe("smollm2-quick", ["profile.measured_k_values=[2, 0]"])
    with pytest.raises(ConfigError, match=r"profile\.compile: expected bool, got 'yes please'"):
        load_recipe("smollm2-quick", ["profile.compile=yes please"])


def test_recipes_command_lists_every_shipped_recipe(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in shipped_recipes():
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert load_recipe(name).description in line


def test_a_bad_override_fails_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "smollm2-smoke", "--set", "distill.train.lr=-1"]) == 2
    assert "distill.train: lr: must be > 0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_schema_names_the_stage_table_s_stages_in_order():
    from polybasic.config import STAGE_NAMES, Recipe
    from polybasic.pipelines.stages import NAMES

    assert STAGE_NAMES == NAMES and Recipe().stages == list(NAMES)
