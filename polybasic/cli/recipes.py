"""The recipe commands: `polybasic run RECIPE` runs every stage the recipe lists, `polybasic <stage>
RECIPE` one of them (table in pipelines.stages, loop in pipelines.run), and `polybasic recipes` lists
the shipped recipes (`--fields`: every recipe field with its default and meaning, docs/recipes.md).

RECIPE is a YAML file or a shipped recipe's name; `--set section.field=value` (repeatable) overrides
any field of it.
"""
from __future__ import annotations

import argparse

from polybasic.config import load_yaml, shipped_recipes
from polybasic.config_docs import render_fields
from polybasic.pipelines.stages import NAMES, STAGES

SET_HELP = ("override a recipe field, e.g. --set distill.train.lr=1e-2 or --set 'bench.categories=[qa, rag]' "
            "(a dotted field path, '=', a YAML value; repeatable)")


def _run(a: argparse.Namespace) -> int:
    if getattr(a, "format", "bundle") == "speculators":
        from polybasic.pipelines.export import run_speculators  # start-up time: torch only when it runs

        run_speculators(a.recipe, a.out, overrides=tuple(a.overrides))
        return 0
    from polybasic.pipelines.run import run_recipe  # start-up time: torch only when a stage runs

    run_recipe(a.recipe, a.out, only=a.only, overrides=tuple(a.overrides))
    return 0


def _add(sub, name: str, help_text: str, only) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("recipe", help="a recipe YAML file, or a shipped recipe's name (`polybasic recipes` lists them)")
    p.add_argument("--out", default=None, help="output folder (default: the recipe's out_dir)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    p.set_defaults(func=_run, only=only)
    return p


def _list(a: argparse.Namespace) -> int:
    if a.fields:
        print(render_fields(), end="")
        return 0
    recipes = shipped_recipes()
    width = max(map(len, recipes))
    for name, path in recipes.items():
        print(f"{name:<{width}}  {load_yaml(path).get('description', '')}")
    print("\nrun one by name from any folder: polybasic run NAME [--set section.field=value ...]")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("recipes", help="list the shipped recipes (polybasic run NAME runs one)",
                       description="The recipes polybasic ships, one line each; `polybasic run NAME` runs one "
                                   "from any folder. --fields prints every recipe field with its default and "
                                   "meaning.")
    p.add_argument("--fields", action="store_true", help="every recipe field, its default and meaning (markdown)")
    p.set_defaults(func=_list)
    _add(sub, "run", f"run every stage the recipe lists ({' -> '.join(NAMES)}), skipping stages whose outputs "
                     "match their inputs' fingerprint and resuming an interrupted one", None)
    for stage in STAGES:
        if stage.name not in sub.choices:  # the bench stage runs through `run`; `bench` is the benchmark command
            p = _add(sub, stage.name, stage.help, (stage.name,))
            if stage.name == "export":
                p.add_argument("--format", choices=("bundle", "speculators"), default="bundle",
                               help="bundle: the planned chain as a bundle (the stage); speculators: the target's "
                                    "eagle3 head (distill/target/head.safetensors) as <out>/speculators, the "
                                    "folder vLLM serves as an eagle3 drafter (needs distill only)")
