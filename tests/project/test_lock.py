"""constraints.txt pins what the tests run with: this environment is its block for this
Python, its pins satisfy pyproject.toml's ranges, and tools/lock.py rewrites one block
while keeping the others."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
#: the extras `make install` installs (the Makefile's EXTRAS)
EXTRAS = set(next(line.split("?=")[1].strip() for line in (ROOT / "Makefile").read_text().splitlines()
                  if line.startswith("EXTRAS ")).split(","))


def _lock():
    spec = importlib.util.spec_from_file_location("lock", ROOT / "tools" / "lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _blocks(text: str) -> dict[str, dict[str, str]]:
    """``{python: {name: version}}`` of a constraints text."""
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and req.marker is not None, line
        python = str(req.marker).split('"')[1]
        out.setdefault(python, {})[req.name] = spec.version
    return out


def test_this_environment_is_the_locked_one() -> None:
    """What `make install` installed here is exactly this Python's block, and the file is
    what tools/lock.py writes (else: `make lock` after testing the new versions)."""
    lock = _lock()
    text = CONSTRAINTS.read_text(encoding="utf-8")
    python = "{}.{}".format(*sys.version_info[:2])
    if python not in _blocks(text):
        pytest.fail(f"constraints.txt has no block for Python {python}")
    pins = lock.closure(lock.project_requirements(ROOT / "pyproject.toml"), EXTRAS)
    assert lock.merge(text, pins, python) == text, (
        "this environment differs from constraints.txt's block for Python " + python + ": "
        + str(sorted(set(pins.items()) ^ set(_blocks(text)[python].items())))
        + "; after testing the new versions, run `make lock`")


def test_the_pins_satisfy_pyproject_and_keep_the_device_floors() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    blocks = _blocks(CONSTRAINTS.read_text(encoding="utf-8"))
    assert set(blocks) >= {"3.9", "3.11"}
    wanted = list(project["dependencies"]) + [r for e in sorted(EXTRAS)
                                              for r in project["optional-dependencies"][e]]
    for python, pins in blocks.items():
        env = {"python_version": python, "python_full_version": python + ".0"}
        for text in wanted:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            pinned = pins.get(req.name.lower())
            if python == "3.9" and pinned is None:  # the 3.9 block is the device's: data, dev
                continue
            assert pinned is not None and req.specifier.contains(pinned, prereleases=True), \
                (python, text, pinned)
    assert blocks["3.11"]["torch"] == "2.13.0"  # the CPU wheel (Makefile)
    # Python 3.9's numba and numpy are the last releases for it
    assert Version(blocks["3.9"]["numba"]).release[:2] == (0, 60)
    assert Version(blocks["3.9"]["numpy"]).release[:2] == (2, 0)
    for name in ("numpy", "numba", "llvmlite", "msgpack", "paho-mqtt", "cryptography", "tomli"):
        assert name in blocks["3.9"], name


def test_lock_rewrites_one_python_s_block_and_keeps_the_others() -> None:
    lock = _lock()
    old = lock.merge("", {"numba": "0.60.0", "numpy": "2.0.2"}, "3.9")
    both = lock.merge(old, {"numba": "0.68.1"}, "3.11")
    assert _blocks(both) == {"3.9": {"numba": "0.60.0", "numpy": "2.0.2"}, "3.11": {"numba": "0.68.1"}}
    again = lock.merge(both, {"numba": "0.68.2", "torch": "2.13.0"}, "3.11")
    assert _blocks(again) == {"3.9": {"numba": "0.60.0", "numpy": "2.0.2"},
                              "3.11": {"numba": "0.68.2", "torch": "2.13.0"}}
    assert again.index("# Python 3.9") < again.index("# Python 3.11")  # ordered by version
    assert lock.merge(again, {"numba": "0.68.2", "torch": "2.13.0"}, "3.11") == again
