"""Command-line entries of the recipe stages: `polybasic <stage> RECIPE.yaml` runs one stage,
`polybasic run RECIPE.yaml` every stage the recipe lists (table in stages.py, loop in run.py)."""
from __future__ import annotations

import argparse

from polybasic.pipelines.stages import NAMES, STAGES


def _run(a: argparse.Namespace) -> int:
    from polybasic.pipelines.run import run_recipe

    run_recipe(a.recipe, a.out, only=a.only)
    return 0


def _add(sub, name: str, help_text: str, only) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("--out", default=None, help="output folder (default: the recipe's out_dir)")
    p.set_defaults(func=_run, only=only)


def add_parsers(sub) -> None:
    _add(sub, "run", f"run every stage the recipe lists ({' -> '.join(NAMES)}), skipping stages whose outputs "
                     "match their inputs' fingerprint and resuming an interrupted one", None)
    for stage in STAGES:
        if stage.name not in sub.choices:  # the bench stage runs through `run`; `bench` is the benchmark command
            _add(sub, stage.name, stage.help, (stage.name,))
