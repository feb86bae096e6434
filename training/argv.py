"""The command line's text into flags (training/flags.py), collecting every problem of it at
once (training/args.py reports them together): bad values, unknown and refused flags. A value
flag given '' is taken out and named unset: it takes its default, whatever the YAML says."""
from __future__ import annotations

import argparse

from common import Problems
from training.flags import unrecognized
from training.megatron_compat import NoOp, Refused


def spellings(parser, argv: list[str]) -> dict[str, str]:
    """dest -> the option string the command line used, where it is not the flag's own name."""
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    used = {}
    for text in argv:
        action = by_option.get(text.split("=")[0])
        if action is not None and text.split("=")[0] != "--" + action.dest.replace("_", "-"):
            used[action.dest] = text.split("=")[0]
    return used


def take_unset(parser, argv: list[str]) -> tuple[list[str], set[str]]:
    """`--flag ''` (or `--flag=`) for a flag that takes a value: the flag's default, whatever the
    YAML sets. Returns the other arguments and the dests unset."""
    by_option = {s: a for a in parser._actions for s in a.option_strings
                 if a.nargs != 0 and not isinstance(a, (Refused, NoOp))}
    kept, unset, i = [], set(), 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        action = by_option.get(name)
        alone = i + 2 >= len(argv) or argv[i + 2].startswith("--")   # '' is the only value
        if action is not None and eq and value == "":
            unset.add(action.dest)
            i += 1
        elif action is not None and not eq and i + 1 < len(argv) and argv[i + 1] == "" and alone:
            unset.add(action.dest)
            i += 2
        else:
            kept.append(argv[i])
            i += 1
    return kept, unset


def parse_flags(parser, argv: list[str], problems: Problems) -> tuple[list[str], argparse.Namespace, set[str]]:
    """argparse's parse, collecting every bad value and unknown flag instead of stopping at the
    first: a flag whose value is refused is taken out and the rest parsed again. Returns the
    arguments taken, the namespace, and the dests of the flags taken out."""
    by_name = {"/".join(a.option_strings): a for a in parser._actions if a.option_strings}
    bad = set()
    for _ in range(len(argv) + 1):
        try:
            args, extras = parser.parse_known_args(argv)
            break
        except argparse.ArgumentError as e:
            problems.add(str(e))
            action = by_name.get(e.argument_name)
            shorter = without(argv, action)
            if len(shorter) == len(argv):
                problems.raise_if_any()
            argv, bad = shorter, bad | {action.dest}
    if extras:
        problems.add(unrecognized(parser, extras))
    return argv, args, bad


def without(argv: list[str], action) -> list[str]:
    """`argv` less every occurrence of `action`'s flag and its values."""
    out, i = [], 0
    while i < len(argv):
        name, eq, _ = argv[i].partition("=")
        i += 1
        if action is None or name not in action.option_strings:
            out.append(argv[i - 1])
            continue
        values = 0 if eq else {None: 1, "?": 1}.get(action.nargs, action.nargs if isinstance(action.nargs, int)
                                                     else len(argv))
        while values and i < len(argv) and not argv[i].startswith("--"):
            i, values = i + 1, values - 1
    return out


def explicit_dests(parser: argparse.ArgumentParser, argv) -> set[str]:
    """Which options the command line set (so that they win over files)."""
    shadow = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, add_help=False, allow_abbrev=False)
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            kwargs = {"dest": action.dest, "nargs": action.nargs} if action.nargs is not None else {"dest": action.dest}
            if action.nargs == 0:   # switches: store_true, store_false, no-op ones
                kwargs = {"dest": action.dest, "action": "store_true"}
            shadow.add_argument(*action.option_strings, **kwargs)
    return set(vars(shadow.parse_known_args(argv)[0]))
