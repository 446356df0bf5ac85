"""The device-side test subset (``pytest -m device``: the modules of tests/device_tests.txt
less their ``host`` tests) that tools/py39_check.sh runs under Python 3.9 stays what it
says: its modules import nothing of the coordinator or torch at module level, a test of
theirs that imports them or runs the ``fedbit`` command is marked ``host``, and it
collects at least its ``minimum`` tests. (The run itself, and that all of it passes, is the 3.9 check's; this catches the
usual cause of a failure there, a coordinator test added to a device module, in
``make test``.)"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from device_subset import MANIFEST, is_device_test, read_manifest

ROOT = Path(__file__).resolve().parents[1]
NOT_ON_A_39_DEVICE = {"coordinator", "torch", "torchvision", "onnx", "onnxruntime", "amqtt", "matplotlib",
                      "benchmarks", "experiments", "tomllib"}


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_the_manifest_names_real_modules_that_import_no_coordinator_or_torch() -> None:
    modules = set(read_manifest().selected)
    for m in sorted(modules | {"tests/conftest.py", "tests/device_subset.py"}):
        bad = _module_level_imports(ROOT / m) & NOT_ON_A_39_DEVICE
        assert not bad, f"{m} imports {sorted(bad)} at module level: not importable on a 3.9 device"


def _needs_more_than_a_device(fn: ast.FunctionDef) -> str | None:
    """Why test ``fn`` cannot run on a 3.9 device (a coordinator/torch import in its body,
    or the ``fedbit`` command among its constants or parameters), or None."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Import):
            roots = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots = {node.module.split(".")[0]}
        else:
            roots = set()
        if roots & NOT_ON_A_39_DEVICE:
            return f"imports {sorted(roots & NOT_ON_A_39_DEVICE)}"
        if isinstance(node, ast.Constant) and node.value == "fedbit":
            return "runs the fedbit command (the coordinator)"
    return None


def _marked_host(fn: ast.FunctionDef) -> bool:
    """``@pytest.mark.host`` on the test, or on the parameters that need more than a
    device (``pytest.param(..., marks=pytest.mark.host)``)."""
    return any("pytest.mark.host" in ast.unparse(d) for d in fn.decorator_list)


def test_a_device_module_test_that_needs_the_coordinator_or_torch_is_marked_host() -> None:
    bad = []
    for m in read_manifest().selected:
        tree = ast.parse((ROOT / m).read_text(encoding="utf-8"))
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            why = _needs_more_than_a_device(fn)
            if why and not _marked_host(fn):
                bad.append(f"{m}::{fn.name} {why}: mark it @pytest.mark.host")
    assert not bad, "\n".join(bad)


def test_the_manifest_rejects_what_it_does_not_know(tmp_path: Path) -> None:
    import pytest

    for text in ("tests/test_x.py\n", "minimum = 3\nsrc/test_x.py\n", "minimum = many\ntests/test_x.py\n",
                 "minimum = 3\ntests/test_x.py::test_one\n", "minimum = 3\n-tests/test_x.py::test_one\n"):
        bad = tmp_path / "m.txt"
        bad.write_text(text)
        with pytest.raises(ValueError, match="m.txt"):
            read_manifest(bad)


def test_the_subset_collects_at_least_its_minimum() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "device_subset.py"), "--collect-only"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("device_subset: {"))
    counts = json.loads(line.split(": ", 1)[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sel = read_manifest()
    assert counts["collected"] >= sel.minimum, (counts, MANIFEST)
    assert counts["deselected"] > 0, counts  # the host tests of the device modules


def test_the_device_mark_is_the_manifests_modules_less_their_host_tests() -> None:
    sel = read_manifest()
    module = sel.selected[0]
    assert is_device_test(f"{module}::test_a[8]", False, sel)
    assert not is_device_test(f"{module}::test_a[32]", True, sel)
    assert not is_device_test("tests/test_not_listed.py::test_a", False, sel)
