"""`--config run.yaml`: the same flags as keys, each value checked as strictly as on the
command line; the command line wins over it (training/args.py)."""
from __future__ import annotations

import argparse
import difflib
import os

import yaml

from common import ConfigError, Problems
from training.megatron_compat import Refused, yaml_refusal


def read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"--config: no such file {path}")
    if not os.path.isfile(path):
        kind = "a directory" if os.path.isdir(path) else "not a regular file"
        raise ConfigError(f"--config {path} is {kind}; pass a YAML file")
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not a text (UTF-8) file") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"--config {path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must be a mapping of flag names to values (key: value lines), "
                          f"got a {type(values).__name__}")
    return values


def yaml_value(action: argparse.Action, key: str, value, path: str):
    """A YAML value for `action`, checked as strictly as the same flag on the command line."""
    where = f"--config {path}: {key}"
    if isinstance(action, Refused):
        return yaml_refusal(action, value, where)
    if action.nargs == 0:  # on/off switches: a YAML true/false, never a string ("false" is true in Python)
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false (unquoted), got {value!r}")
        return value
    if action.nargs == "+":
        items = value if isinstance(value, list) else str(value).split()
        if not items or any(isinstance(v, (list, dict)) for v in items):
            raise ConfigError(f"{where} must be a value or a list of values, got {value!r}")
        return [str(v) for v in items]
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{where} takes one value, got {value!r}")
    if isinstance(value, bool) and action.type is None:
        raise ConfigError(f"{where} takes a value, not {str(value).lower()}")
    text = str(value)
    if action.type is not None:
        if isinstance(value, bool):  # str(True) would read as a number-parse error; say it plainly
            expected = getattr(action.type, "expected", "a number")
            raise ConfigError(f"{where} must be {expected}, got {str(value).lower()}")
        try:
            value = action.type(text)
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{where}: {e}") from None
    else:
        value = text
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def apply_yaml(parser, args, explicit: set[str], problems: Problems) -> set[str]:
    """The --config YAML's values under the command line's; every bad key joins `problems`.
    Returns the dests of the values refused."""
    bad = set()
    values = read_yaml(args.config)
    known = {a.dest: a for a in parser._actions if a.option_strings}
    by_flag = {o[2:].replace("-", "_"): a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        action = by_flag.get(dest, known.get(dest))
        if action is None or dest in ("config", "help"):
            close = difflib.get_close_matches(dest, [d for d, a in known.items() if a.help != argparse.SUPPRESS], n=1)
            hint = f"; did you mean '{close[0].replace('_', '-')}'?" if close else ""
            problems.add(f"--config {args.config}: unknown key '{key}'{hint}")
            continue
        if value is None:
            continue  # `key:` with no value keeps the default
        bad.add(action.dest)   # until its value is taken
        with problems.collect():
            value = yaml_value(action, key, value, args.config)
            if isinstance(action, argparse._StoreFalseAction) and dest != action.dest:
                value = not value   # `no-log-loss-scale-to-tensorboard: true` turns it off
            if action.dest in explicit or action.dest in args.unset or value is None:
                continue  # the command line wins
            setattr(args, action.dest, value)
            explicit.add(action.dest)
            args.from_yaml.add(action.dest)
        if action.dest in explicit or action.dest in args.unset or value is None or \
                getattr(args, action.dest) == value:
            bad.discard(action.dest)
    return bad
