"""DESIGN.md's dependency rules, enforced statically and at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements executed at import: the body and its try/if/with blocks, but not
    function or class bodies, nor `if TYPE_CHECKING:` blocks."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += _module_level(node.orelse)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    out += _module_level(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return out


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, executed at import time?) for every import statement in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    top_level = {id(node) for node in _module_level(tree.body)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top_level))
    return out


def _files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return files


def _root(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("package", ["edge_client", "firmware_models", "hw_profiles"])
def test_device_side_never_imports_coordinator(package: str) -> None:
    bad = [(str(f.relative_to(ROOT)), m) for f in _files(package) for m, _ in _imports(f) if _root(m) == "coordinator"]
    assert not bad


@pytest.mark.parametrize("package", ["firmware_models", "hw_profiles"])
def test_specs_and_profiles_import_neither_sdk_nor_server(package: str) -> None:
    bad = [(str(f.relative_to(ROOT)), m) for f in _files(package) for m, _ in _imports(f)
           if _root(m) in {"edge_client", "coordinator"}]
    assert not bad


@pytest.mark.parametrize("package", ["edge_client", "firmware_models", "hw_profiles"])
def test_no_module_level_torch_on_the_device_side(package: str) -> None:
    bad = [(str(f.relative_to(ROOT)), m) for f in _files(package) for m, top in _imports(f)
           if top and _root(m) in {"torch", "torchvision", "onnx", "onnxruntime"}]
    assert not bad


def test_importing_every_device_module_leaves_torch_and_coordinator_out() -> None:
    code = """
import importlib, pkgutil, sys
import edge_client, firmware_models, hw_profiles
names = []
for pkg in (edge_client, firmware_models, hw_profiles):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
assert len(names) >= 5, names
leaked = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "coordinator", "matplotlib"})
print(len(names), leaked)
sys.exit(1 if leaked else 0)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


#: what the coordinator may import from the device SDK: its library (``hparams``: what an
#: announcement may carry, part of the wire format; ``auth``: the credentials format and
#: the MAC), not its application
COORDINATOR_MAY_USE = {"errors", "protocol", "hparams", "codecs", "intnn", "trainers", "data",
                       "transport", "auth"}
#: the one coordinator module that runs real device runtimes, by design
RUNS_DEVICES = {"coordinator/emulator.py"}


def test_coordinator_uses_only_the_device_sdk_library() -> None:
    """DESIGN.md: ``coordinator`` may import ``edge_client``'s library modules, never its
    application layer (``runtime``, ``cli``), except the emulator; checked for every import
    statement, function-level ones included."""
    bad = []
    for f in _files("coordinator"):
        rel = str(f.relative_to(ROOT))
        for m, _ in _imports(f):
            parts = m.split(".")
            if parts[0] != "edge_client" or rel in RUNS_DEVICES:
                continue
            if len(parts) < 2 or parts[1] not in COORDINATOR_MAY_USE:
                bad.append((rel, m))
    assert not bad


def test_the_dependency_check_sees_function_level_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from edge_client.runtime import DeviceRuntime\n")
    assert ("edge_client.runtime", False) in _imports(f)
