"""Write the versions installed in this interpreter's environment into constraints.txt.

    python tools/lock.py [--extras coordinator,data,dev,onnx,cluster] [--out constraints.txt]

Pins every distribution that fedbit with those extras needs (its requirements in
pyproject.toml, theirs, and so on, markers evaluated for this interpreter) at the version
installed here, as one block marked ``python_version == "X.Y"`` for this Python; the
blocks of other Pythons in the file are kept. ``make install`` installs with
``-c constraints.txt``; the README ("Two commands") says when and how to refresh it. Runs
on the device side's oldest Python too (tools/py39_check.sh writes the 3.9 block with it).
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
# resolve freely within pyproject.toml's ranges. Written by tools/lock.py: the README
# ("Two commands") says how to refresh it.
"""
MARKER = re.compile(r';\s*python_version\s*==\s*"(\d+\.\d+)"\s*$')


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_requirements(pyproject: Path | None = None) -> list[str]:
    """fedbit's requirements as ``Requires-Dist`` lines (extras as ``extra == "x"``
    markers): from ``pyproject.toml`` when there is one (the source of truth, also before
    the project is reinstalled), else from the installed distribution (a wheel's venv)."""
    if pyproject is None or not pyproject.is_file():
        return list(metadata.distribution(PROJECT).requires or [])
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    out = list(project["dependencies"])
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for text in reqs:
            req = Requirement(text)
            marker = f'extra == "{extra}"' + (f" and ({req.marker})" if req.marker else "")
            req.marker = None
            out.append(f"{req}; {marker}")
    return out


def closure(requirements: list[str], extras: set[str]) -> dict[str, str]:
    """``{canonical name: installed version}`` of what ``requirements`` (with ``extras``)
    need here, their requirements and so on."""
    pins: dict[str, str] = {}
    todo: list[tuple[list[str], frozenset[str]]] = [(requirements, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        texts, wanted = todo.pop()
        for text in texts:
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                continue
            key = (canonical(req.name), frozenset(req.extras))
            if key in seen or canonical(req.name) == canonical(PROJECT):
                continue
            seen.add(key)
            try:
                dist = metadata.distribution(req.name)
            except metadata.PackageNotFoundError:
                raise SystemExit(f"lock: {req.name} is needed but not installed in {sys.prefix}") from None
            pins[canonical(req.name)] = dist.version.split("+")[0]  # 2.13.0+cpu matches ==2.13.0
            todo.append((list(dist.requires or []), frozenset(req.extras)))
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
    pins = closure(project_requirements(ROOT / "pyproject.toml"), {e for e in args.extras.split(",") if e})
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    args.out.write_text(merge(old, pins, python), encoding="utf-8")
    print(f"lock: {len(pins)} pins for Python {python} ({platform.machine()}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
