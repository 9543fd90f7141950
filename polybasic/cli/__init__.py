"""`polybasic` command line: generate, bench, serve-check, push, recipes, and the recipe stages (run, or one of
quantize, distill, profile, plan, export).

Building the parser and checking arguments import no torch, transformers or lightning: every
command imports what it runs when it runs (start-up time), after the cheap checks of its input.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys

from polybasic import __version__
from polybasic.cli import bench, generate, push, recipes, serve_check
from polybasic.errors import PolybasicError


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions' line breaks (the chain forms) and appends '(default: X)' to every option
    with a default other than None / False."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.default is not None and action.default is not False
                and action.default != argparse.SUPPRESS and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (imports no torch)."""
    parser = argparse.ArgumentParser(prog="polybasic", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"polybasic {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser,
                                                               formatter_class=HelpFormatter))
    generate.add_parser(sub)
    bench.add_parser(sub)
    serve_check.add_parser(sub)
    push.add_parser(sub)
    recipes.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except PolybasicError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
