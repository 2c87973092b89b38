"""The `slimline` command: a thin shell that builds the library's own configs and calls it.

Each feature area owns its subcommands in a module with ``register(subparsers)``; that function
adds its parser(s) and sets ``func`` (called with the parsed args, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from .errors import SlimlineError

__all__ = ["main"]

COMMAND_MODULES: tuple[str, ...] = (
    "slimline.commands",
    "slimline.loadtest.cli",
    "slimline.serve.cli",
    "slimline.edge.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="slimline",
        description="Take a trained model to a lean, served, measured model.",
    )
    parser.add_argument("--version", action="version", version=f"slimline {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except SlimlineError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
