"""Command-line entries of the recipe stages: `polybasic <stage> RECIPE.yaml`.

Each stage module registers itself in STAGES (name -> (help, run(recipe_path, out_dir) -> int)).
"""
from __future__ import annotations


STAGES: dict[str, tuple[str, object]] = {}


def add_parsers(sub) -> None:
    from polybasic.pipelines import stages  # noqa: F401  (registers the stages that exist)

    for name, (help_text, run) in STAGES.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("recipe", help="recipe YAML (see recipes/)")
        p.add_argument("--out", default=None, help="output folder (default: the recipe's out_dir)")
        p.set_defaults(func=lambda a, run=run: run(a.recipe, a.out))
