"""Run (or collect) the device-side test subset: the ``device`` tests of the modules
``tests/device_tests.txt`` lists (tests/conftest.py marks them; ``host`` tests are not).

``python tests/device_subset.py [--collect-only] [--installed] [PYTEST ARGS...]`` runs
``pytest -m device`` on those modules and fails unless every selected test passed (no
failure, error or skip) and at least the manifest's ``minimum`` did. ``--installed``: the device
packages must come from an installed wheel (site-packages), not from a source tree.
Prints one JSON line with the counts. tools/py39_check.sh runs it under Debian
bullseye's Python 3.9, so this file runs on 3.9.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).resolve().parent / "device_tests.txt"


@dataclass
class Selection:
    selected: list[str]
    minimum: int


def read_manifest(path: Path = MANIFEST) -> Selection:
    """The manifest's modules (paths relative to the folder above tests/) and minimum;
    ``ValueError`` naming the line for anything else."""
    selected: list[str] = []
    minimum = None
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("minimum"):
            key, _, value = line.partition("=")
            if key.strip() != "minimum" or not value.strip().isdigit():
                raise ValueError(f"{path}:{n}: expected 'minimum = N', got {raw!r}")
            minimum = int(value)
        elif line.startswith("tests/") and line.endswith(".py"):
            selected.append(line)
        else:
            raise ValueError(f"{path}:{n}: not a test module under tests/: {raw!r}")
    if minimum is None or not selected:
        raise ValueError(f"{path}: needs 'minimum = N' and at least one module")
    return Selection(selected, minimum)


def is_device_test(nodeid: str, host: bool, selection: Selection) -> bool:
    """Whether the test ``nodeid`` (``tests/packages/edge_client/test_x.py::name[param]``) belongs to the
    device subset: its module is listed and it is not marked ``host``."""
    return not host and nodeid.split("::")[0] in selection.selected


@dataclass(eq=False)  # hashable: pytest keeps its plugins in sets
class Outcomes:
    """A pytest plugin counting what happened to each test."""

    collected: int = 0
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    deselected: list[str] = field(default_factory=list)

    def pytest_deselected(self, items: list[Any]) -> None:
        self.deselected += [item.nodeid for item in items]

    def pytest_collection_finish(self, session: Any) -> None:
        self.collected = len(session.items)

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append(report.nodeid)
        elif report.skipped:
            self.skipped.append(report.nodeid)
        elif report.when == "call" and report.passed:
            self.passed.append(report.nodeid)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    collect_only = "--collect-only" in args
    installed = "--installed" in args
    args = [a for a in args if a not in ("--collect-only", "--installed")]
    sel = read_manifest()
    root = MANIFEST.parent.parent
    import pytest

    if installed:
        import edge_client
        import firmware_models
        import hw_profiles

        local = [m.__name__ for m in (edge_client, firmware_models, hw_profiles)
                 if "site-packages" not in str(m.__file__)]
        if local:
            print(f"device_subset: {local} not imported from an installed wheel", file=sys.stderr)
            return 2
    outcomes = Outcomes()
    pytest_args = [str(root / s) for s in sel.selected]
    pytest_args += ["-m", "device", "-p", "no:cacheprovider", "--rootdir", str(root)]
    if collect_only:
        pytest_args += ["--collect-only", "-q"]
    rc = int(pytest.main(pytest_args + args, plugins=[outcomes]))
    summary = {"python": sys.version.split()[0], "collected": outcomes.collected,
               "passed": len(outcomes.passed), "failed": len(outcomes.failed),
               "skipped": len(outcomes.skipped), "deselected": len(outcomes.deselected),
               "minimum": sel.minimum, "pytest_exit": rc}
    print("device_subset: " + json.dumps(summary), flush=True)
    problems = []
    if outcomes.collected < sel.minimum:
        problems.append(f"the selection holds {outcomes.collected} tests, fewer than the minimum {sel.minimum}")
    if not collect_only:
        if outcomes.skipped:
            problems.append(f"skipped (the subset must pass, not skip): {outcomes.skipped[:10]}")
        if len(outcomes.passed) < sel.minimum:
            problems.append(f"{len(outcomes.passed)} passed, fewer than the minimum {sel.minimum}")
    for p in problems:
        print(f"device_subset: {p}", file=sys.stderr)
    return rc or (1 if problems else 0)


if __name__ == "__main__":
    sys.exit(main())
