"""`tokenfab serve --config FILE`: serve's flags from a YAML or JSON file (or a Ray Serve config).

A flags file is one mapping of serve flags, under their flag names with or without dashes:

    # written by `tokenfab tune`, or by hand
    quantization: int8
    max-num-seqs: 8
    num_threads: 2
    enable_chunked_prefill: false
    speculative_config: {method: ngram, num_speculative_tokens: 4}

Each value goes through the flag's own parsing and checks (types, choices, sizes such as `512MiB`), as
if it had been typed on the command line, so a file can hold nothing the command line would refuse. A
key that names no serve flag is refused with the closest names. The file's values are defaults: a flag
given on the command line beside `--config` wins.

A document with an `applications` key is a Ray Serve config instead (serve_spec.py, docs/scale_out.md),
and `--config` keeps that meaning for it: this module leaves it alone.
"""
from __future__ import annotations

import argparse
import difflib
import json


def read_document(path: str):
    """The parsed YAML (JSON is YAML) document at `path`; ValueError names the file and the problem."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML or JSON ({e})") from None


def is_ray_serve_config(doc) -> bool:
    return isinstance(doc, dict) and "applications" in doc


def _actions_by_key(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every name a file may use for a flag: its dest and its long option names, with underscores."""
    out = {}
    for a in parser._actions:
        if a.dest in ("help", "config") or a.dest == argparse.SUPPRESS:
            continue
        out[a.dest] = a
        for opt in a.option_strings:
            if opt.startswith("--"):
                name = opt[2:].replace("-", "_")
                if not name.startswith("no_") or isinstance(a, argparse._StoreFalseAction):
                    out.setdefault(name, a)
    return out


def _tokens(action: argparse.Action, value, key: str, path: str) -> list[str]:
    """The command-line words that give `action` this value."""
    if not action.option_strings:                       # the positional MODEL
        return [str(value)]
    flag = next(o for o in action.option_strings if o.startswith("--"))
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"--config {path}: {key} must be true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value == isinstance(action, argparse._StoreTrueAction) else []
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):
            return [w for v in value for w in (flag, str(v))]
        if action.nargs in ("+", "*"):
            return [flag, *map(str, value)] if value else []
        raise ValueError(f"--config {path}: {key} takes one value, got a list {value!r}")
    if value is None:
        return []
    return [flag, str(value)]


def flag_defaults(parser: argparse.ArgumentParser, path: str) -> dict | None:
    """The parsed values of the flags file at `path`, by dest, to become `parser`'s defaults.
    None when the file is a Ray Serve config (serve_spec.py reads those)."""
    doc = read_document(path)
    if is_ray_serve_config(doc):
        return None
    if not isinstance(doc, dict):
        raise ValueError(f"--config {path}: expected a mapping of serve flags (e.g. `max_num_seqs: 8`) or a Ray "
                         f"Serve config, got {type(doc).__name__}")
    known = _actions_by_key(parser)
    words: list[str] = []
    dests = []
    for raw_key, value in doc.items():
        key = str(raw_key).replace("-", "_")
        if key == "config":
            raise ValueError(f"--config {path}: a config file cannot name another one (config: {value!r})")
        action = known.get(key)
        if action is None:
            near = difflib.get_close_matches(key, known, n=3)
            raise ValueError(f"--config {path}: {raw_key!r} is not a serve flag"
                             + (f"; did you mean {' or '.join(near)}?" if near else "; see `tokenfab serve --help`"))
        words += _tokens(action, value, str(raw_key), path)
        dests.append(action.dest)

    def refuse(message: str):
        raise ValueError(f"--config {path}: {message}")

    parser.error = refuse                              # the flag's own checks, reported against the file
    try:
        parsed = parser.parse_args(words)
    finally:
        del parser.error
    return {d: getattr(parsed, d) for d in dests}
