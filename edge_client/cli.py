"""``fedbit-edge``: the device-side command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from edge_client import __version__


def _cmd_profiles(args: argparse.Namespace) -> int:
    from hw_profiles import list_profiles

    rows = list_profiles()
    head = f"{'profile':<22} {'bits':>4} {'trainer':<7} {'uplink codec':<12} {'RAM MB':>7} {'up kbps':>9}"
    print(head)
    print("-" * len(head))
    for p in rows:
        codec = f"{p.codec}-{p.codec_bits}"
        print(f"{p.name:<22} {p.compute_bits:>4} {p.trainer:<7} {codec:<12} {p.ram_mb:>7} {p.uplink_kbps:>9.0f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbit-edge",
        description="fedbit device SDK: integer-only local training, compressed uplinks, MQTT.",
    )
    parser.add_argument("--version", action="version", version=f"fedbit-edge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("profiles", help="list the bundled hardware profiles")
    p.set_defaults(func=_cmd_profiles)
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
