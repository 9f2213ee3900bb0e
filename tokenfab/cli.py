"""The ``tokenfab`` command. Each part registers its own sub-commands.

Sub-command modules expose ``add_parser(subparsers)``; each parser sets ``func(args) -> int``.
Modules are imported lazily-enough: registering a parser must not import torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from tokenfab.cli_errors import CLIError
from tokenfab.version import __version__

# (module, what it registers). Order is the order of `tokenfab --help`.
_COMMAND_MODULES = [
    "tokenfab.engine_cli",   # generate, chat, info
    "tokenfab.server.cli",   # serve
    "tokenfab.bench.cli",    # bench
    "tokenfab.quant.cli",    # quant
    "tokenfab.quant.prune_cli",    # prune
    "tokenfab.plan.cli",     # plan
    "tokenfab.doctor.cli",   # doctor
    "tokenfab.server.batch_cli",   # batch run
    "tokenfab.tune.cli",     # tune
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfab", description="Run, serve, benchmark, quantize and plan LLM inference.")
    parser.add_argument("--version", action="version", version=f"tokenfab {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that part is not written yet
                continue
            raise
        mod.add_parser(subs)
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Each (sub-)sub-command records its full name (`tokenfab plan roofline`) for error messages;
    the innermost parser's default wins, as argparse copies a sub-parser's namespace over its parent's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(command_prog=sub.prog.split(" [")[0])
                _name_commands(sub)


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str] | None,
                       args: argparse.Namespace) -> argparse.Namespace:
    """A command whose `--config FILE` holds its flags (`serve`): the file's values become that command's
    defaults and the command line is parsed again, so a flag typed beside `--config` wins."""
    read = getattr(args, "config_defaults", None)
    if read is None or not getattr(args, "config", None):
        return args
    defaults = read(args.config)
    if defaults is None:            # a file the command reads itself (serve: a Ray Serve config)
        return args
    args.config_parser.set_defaults(**defaults)
    path = args.config
    args = parser.parse_args(argv)
    args.config, args.config_file = None, path
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        args = _apply_config_file(parser, argv, args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (CLIError, ValueError, FileNotFoundError) as e:
        print(f"{getattr(args, 'command_prog', None) or f'tokenfab {args.command}'}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
