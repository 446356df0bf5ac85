"""Write the versions installed in this interpreter's environment into constraints.txt.

    python tools/lock.py [--extras coordinator,data,dev,onnx,cluster] [--out constraints.txt]

Pins every distribution that fedbit with those extras needs (its requirements, theirs, and
so on, markers evaluated for this interpreter) at the version installed here, as one
block marked ``python_version == "X.Y"`` for this Python; the blocks of other Pythons in
the file are kept. ``make install`` installs with ``-c constraints.txt``; README
"Reproducible installs" says when and how to refresh it. Runs on the device side's oldest
Python too (tools/py39_check.sh writes the 3.9 block with it).
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a venv without packaging: pip's copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "fedbit"
HEADER = """\
# The versions fedbit's tests and benchmarks were made with, one block per Python (the
# host's 3.11; 3.9, the device side's oldest, from tools/py39_check.sh). Used by
# `make install` (pip install -c constraints.txt) and tools/py39_check.sh; other Pythons
# resolve freely within pyproject.toml's ranges. Written by tools/lock.py: README
# "Reproducible installs" says how to refresh it.
"""
MARKER = re.compile(r';\s*python_version\s*==\s*"(\d+\.\d+)"\s*$')


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(project: str, extras: set[str]) -> dict[str, str]:
    """``{canonical name: installed version}`` of what ``project[extras]`` needs here."""
    pins: dict[str, str] = {}
    todo = [(project, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (canonical(name), wanted) in seen:
            continue
        seen.add((canonical(name), wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"lock: {name} is needed but not installed in {sys.prefix}") from None
        if canonical(name) != canonical(project):
            pins[canonical(name)] = dist.version.split("+")[0]  # 2.13.0+cpu matches ==2.13.0
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                todo.append((req.name, frozenset(req.extras)))
    return pins


def merge(existing: str, pins: dict[str, str], python: str) -> str:
    """``existing`` with its block for ``python`` replaced by ``pins``."""
    kept: dict[str, list[str]] = {}
    for line in existing.splitlines():
        m = MARKER.search(line)
        if m and m.group(1) != python and not line.lstrip().startswith("#"):
            kept.setdefault(m.group(1), []).append(line)
    kept[python] = [f'{name}=={version}; python_version == "{python}"'
                    for name, version in sorted(pins.items())]
    blocks = [f"\n# Python {v}\n" + "\n".join(lines) + "\n"
              for v, lines in sorted(kept.items(), key=lambda kv: tuple(map(int, kv[0].split("."))))]
    return HEADER + "".join(blocks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extras", default="coordinator,data,dev,onnx,cluster")
    ap.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    args = ap.parse_args(argv)
    python = "{}.{}".format(*sys.version_info[:2])
    pins = closure(PROJECT, {e for e in args.extras.split(",") if e})
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    args.out.write_text(merge(old, pins, python), encoding="utf-8")
    print(f"lock: {len(pins)} pins for Python {python} ({platform.machine()}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
