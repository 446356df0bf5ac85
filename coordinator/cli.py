"""``fedbit``: the coordinator-side command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from coordinator import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbit",
        description="fedbit coordinator: full-precision aggregation server for low-bitwidth fleets.",
    )
    parser.add_argument("--version", action="version", version=f"fedbit {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
