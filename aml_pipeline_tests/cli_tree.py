"""The command line's parsers, walked: every subcommand and its flags (the docs and CLI tests)."""

from __future__ import annotations

import argparse


def parser_tree(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(subcommand path, parser) of the command and of every subcommand, depth first."""
    yield path, parser
    for action in parser._actions:  # argparse has no public walk over its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parser_tree(sub, (*path, name))


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
