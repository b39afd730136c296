"""The `vela` command line.

Each subcommand is registered by one `_add_<name>` function below and runs a
handler that imports its module lazily, so `vela place` never loads torch and
`vela --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vela", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args) or 0)
    except ValueError as err:  # user-caused errors: message only, no traceback
        print(f"vela {args.command}: error: {err}", file=sys.stderr)
        return 2


# --- subcommands -------------------------------------------------------------

_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def _subcommand(fn: Callable[[argparse._SubParsersAction], None]):
    _SUBCOMMANDS.append(fn)
    return fn


if __name__ == "__main__":
    sys.exit(main())
