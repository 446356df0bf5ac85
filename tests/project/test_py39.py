"""The device side stays runnable on Python 3.9 (issue 24), checked statically here; the
real proof is ``tools/py39_check.sh`` (``.ci/run``), which runs it under a Debian
bullseye Python 3.9.

Statically: the declared floors (``requires-python``, ``PYTHON_FLOOR`` twice, the
``tomli`` fallback), ruff linting the device packages as py39 (3.10+ syntax is an error
there and the UP rules never rewrite into it), and what ruff cannot see, found by
:func:`py39_problems`: 3.10+ calls (``zip(strict=)``, ``dataclass(slots=)``,
``int.bit_count``, ...), 3.10+ names of the standard library (``itertools.pairwise``,
``typing.TypeAlias``, ``datetime.UTC``, an unguarded ``tomllib``, ...) and ``X | Y`` of
types evaluated at run time (``isinstance(x, int | float)``, a type alias, a
``cast``, an annotation without ``from __future__ import annotations``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_PACKAGES = ("edge_client", "firmware_models", "hw_profiles")

#: module -> {name: the Python that added it}, for names a 3.9 device would not find
NEW_NAMES: dict[str, dict[str, str]] = {
    "itertools": {"pairwise": "3.10", "batched": "3.12"},
    "types": {"NoneType": "3.10", "EllipsisType": "3.10", "NotImplementedType": "3.10",
              "UnionType": "3.10"},
    "typing": {n: "3.10" for n in ("TypeAlias", "ParamSpec", "ParamSpecArgs", "ParamSpecKwargs",
                                   "Concatenate", "TypeGuard", "is_typeddict")}
    | {n: "3.11" for n in ("Self", "LiteralString", "Never", "assert_never", "assert_type",
                           "reveal_type", "Required", "NotRequired", "TypeVarTuple", "Unpack",
                           "dataclass_transform", "get_overloads", "clear_overloads")}
    | {"override": "3.12", "TypeAliasType": "3.12"},
    "datetime": {"UTC": "3.11"},
    "enum": {n: "3.11" for n in ("StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify",
                                 "member", "nonmember", "global_enum", "show_flag_values")},
    "contextlib": {"aclosing": "3.10", "chdir": "3.11"},
    "asyncio": {"TaskGroup": "3.11", "timeout": "3.11", "timeout_at": "3.11", "Runner": "3.11",
                "Barrier": "3.11"},
    "dataclasses": {"KW_ONLY": "3.10"},
    "inspect": {"get_annotations": "3.10"},
    "hashlib": {"file_digest": "3.11"},
    "operator": {"call": "3.11"},
    "math": {"cbrt": "3.11", "exp2": "3.11"},
    "statistics": {"correlation": "3.10", "covariance": "3.10", "linear_regression": "3.10"},
    "sys": {"orig_argv": "3.10", "stdlib_module_names": "3.10", "exception": "3.11"},
    "logging": {"getLevelNamesMapping": "3.11"},
    "builtins": {"aiter": "3.10", "anext": "3.10", "ExceptionGroup": "3.11",
                 "BaseExceptionGroup": "3.11", "EncodingWarning": "3.10"},
}
#: modules a 3.9 device does not have (unless imported under a version check)
NEW_MODULES = {"tomllib": "3.11", "wsgiref.types": "3.11"}
#: keyword arguments that 3.10+ added: (function name, keyword) -> the Python that added it
NEW_KEYWORDS = {("zip", "strict"): "3.10", ("dataclass", "slots"): "3.10",
                ("dataclass", "kw_only"): "3.10", ("dataclass", "match_args"): "3.10",
                ("dataclass", "weakref_slot"): "3.11", ("field", "kw_only"): "3.10",
                ("bisect", "key"): "3.10", ("bisect_left", "key"): "3.10",
                ("bisect_right", "key"): "3.10", ("insort", "key"): "3.10",
                ("insort_left", "key"): "3.10", ("insort_right", "key"): "3.10"}
#: methods that 3.10+ added to builtin types
NEW_METHODS = {"bit_count": "3.10 (int.bit_count)"}
#: names that are types for certain, so ``A | B`` of them builds a union at run time
BUILTIN_TYPES = {"int", "float", "complex", "bool", "str", "bytes", "bytearray", "memoryview",
                 "list", "tuple", "dict", "set", "frozenset", "type", "object", "slice", "range"}
NUMPY_TYPES = {"ndarray", "generic", "number", "integer", "signedinteger", "unsignedinteger",
               "floating", "complexfloating", "bool_", "int8", "int16", "int32", "int64", "uint8",
               "uint16", "uint32", "uint64", "float16", "float32", "float64", "intp", "uintp"}


def _version_guarded(test: ast.expr) -> bool:
    """``sys.version_info >= (3, N)`` (or ``<``/``>``) anywhere in an ``if`` test."""
    return "version_info" in ast.unparse(test)


def _type_like(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if isinstance(node, ast.Name):
        return node.id in BUILTIN_TYPES or (node.id[:1].isupper() and not node.id.isupper())
    if isinstance(node, ast.Attribute):
        a = node.attr
        return a in NUMPY_TYPES or (a[:1].isupper() and not a.isupper())
    if isinstance(node, ast.Subscript):  # list[int], Optional[X], ...
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _type_like(node.left) or _type_like(node.right)
    return False


def py39_problems(source: str, filename: str = "<source>") -> list[str]:
    """What in ``source`` needs a Python newer than 3.9, as ``file:line: what`` strings.

    Code under ``if sys.version_info ...`` and ``if TYPE_CHECKING:`` is exempt (it runs
    only where it can), and so is an import tried with an ``except ImportError`` fallback;
    annotations are exempt in a module with ``from __future__ import
    annotations`` (they stay strings), evaluated everywhere else.
    """
    try:
        tree = ast.parse(source, filename=filename, feature_version=(3, 9))
    except SyntaxError as exc:
        return [f"{filename}:{exc.lineno}: syntax newer than Python 3.9 ({exc.msg})"]
    lazy = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
               and any(a.name == "annotations" for a in n.names) for n in tree.body)
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (_version_guarded(node.test) or "TYPE_CHECKING" in ast.unparse(node.test)):
            exempt |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & {
                    n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)} for h in node.handlers):
            exempt |= {id(stmt) for stmt in node.body if isinstance(stmt, (ast.Import, ast.ImportFrom))}
        if lazy:
            annotations: list[ast.expr | None] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                annotations += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                annotations += [a.vararg.annotation if a.vararg else None,
                                a.kwarg.annotation if a.kwarg else None, node.returns]
            elif isinstance(node, ast.AnnAssign):
                annotations.append(node.annotation)
            exempt |= {id(n) for ann in annotations if ann is not None for n in ast.walk(ann)}
    aliases: dict[str, str] = {}  # local name -> module, for `import x as y`
    out: list[str] = []

    def bad(node: ast.AST, what: str) -> None:
        out.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name in NEW_MODULES:
                    bad(node, f"import {a.name} (Python {NEW_MODULES[a.name]}; guard it with "
                              "sys.version_info, e.g. tomli below 3.11)")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in NEW_MODULES:
                bad(node, f"from {node.module} import (Python {NEW_MODULES[node.module]})")
            for a in node.names:
                added = NEW_NAMES.get(node.module, {}).get(a.name)
                if added:
                    bad(node, f"{node.module}.{a.name} (Python {added})")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            added = NEW_NAMES.get(module or "", {}).get(node.attr)
            if added:
                bad(node, f"{module}.{node.attr} (Python {added})")
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            for kw in node.keywords:
                added = NEW_KEYWORDS.get((fname, kw.arg or ""))
                if added:
                    bad(node, f"{fname}({kw.arg}=...) (Python {added})")
            if isinstance(f, ast.Attribute) and f.attr in NEW_METHODS:
                bad(node, f".{f.attr}() (Python {NEW_METHODS[f.attr]})")
            if isinstance(f, ast.Name) and f.id in NEW_NAMES["builtins"]:
                bad(node, f"{f.id}() (Python {NEW_NAMES['builtins'][f.id]})")
            if fname in ("to_bytes", "from_bytes") and len(node.args) < 2 and not any(
                    kw.arg == "byteorder" for kw in node.keywords):
                bad(node, f"{fname}() without byteorder (its default is Python 3.11's)")
            if fname == "get_type_hints":
                bad(node, "get_type_hints() evaluates annotations (X | Y fails on Python 3.9)")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            if _type_like(node.left) and _type_like(node.right):
                bad(node, f"{ast.unparse(node)} builds a union at run time (Python 3.10; "
                          "a tuple for isinstance, Optional/Union for an alias)")
                exempt |= {id(n) for n in ast.walk(node)}  # A | B | C once, not again as A | B
        elif isinstance(node, ast.Name) and node.id in ("ExceptionGroup", "BaseExceptionGroup"):
            bad(node, f"{node.id} (Python 3.11)")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def _runs_on_39() -> list[str]:
    """Besides the device packages, what tools/py39_check.sh runs under Python 3.9: the
    device-side test modules (tests/device_tests.txt), their conftest and runner, the probe,
    the lock writer (FEDBIT_LOCK_REFRESH=1)."""
    from device_subset import read_manifest

    tests = {s.split("::")[0] for s in read_manifest().selected}
    return sorted(tests | {"tests/conftest.py", "tests/device_subset.py", "tools/train_probe.py",
                           "tools/lock.py"})


def _device_files() -> list[Path]:
    files = [f for pkg in DEVICE_PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50, files
    return files + [ROOT / f for f in _runs_on_39()]


def test_the_device_side_uses_nothing_newer_than_python_3_9() -> None:
    problems = [p for f in _device_files()
                for p in py39_problems(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("code,needle", [
    ("def f(x):\n    match x:\n        case 1:\n            pass\n", "syntax newer"),
    ("try:\n    pass\nexcept* ValueError:\n    pass\n", "syntax newer"),
    ("zip([1], [2], strict=True)\n", "zip(strict=...) (Python 3.10)"),
    ("from dataclasses import dataclass\n@dataclass(slots=True)\nclass A:\n    x: int\n", "dataclass(slots="),
    ("import dataclasses\n@dataclasses.dataclass(frozen=True, kw_only=True)\nclass A:\n    x: int\n", "kw_only"),
    ("isinstance(1, int | float)\n", "int | float builds a union"),
    ("import numpy as np\nisinstance(1, int | np.integer)\n", "builds a union"),
    ("issubclass(bool, (int | None))\n", "builds a union"),
    ("Number = int | float\n", "builds a union"),
    ("from typing import cast\ny = cast(list[int] | None, [])\n", "builds a union"),
    ("def f(x: int | None) -> None:\n    pass\n", "builds a union"),  # no __future__ import
    ("x: int | None = None\n", "builds a union"),
    ("import tomllib\n", "import tomllib"),
    ("from tomllib import loads\n", "from tomllib import"),
    ("try:\n    import tomllib\nexcept KeyError:\n    pass\n", "import tomllib"),
    ("from itertools import pairwise\n", "itertools.pairwise (Python 3.10)"),
    ("import itertools as it\nit.pairwise([1, 2])\n", "itertools.pairwise (Python 3.10)"),
    ("import typing\nT: typing.TypeAlias = int\n", "typing.TypeAlias"),
    ("from typing import Self\n", "typing.Self (Python 3.11)"),
    ("import datetime\ndatetime.datetime.now(datetime.UTC)\n", "datetime.UTC"),
    ("from enum import StrEnum\n", "enum.StrEnum"),
    ("(5).bit_count()\n", "bit_count"),
    ("n = 3\nn.to_bytes(2)\n", "without byteorder"),
    ("int.from_bytes(b'ab')\n", "without byteorder"),
    ("import typing\ntyping.get_type_hints(int)\n", "get_type_hints"),
    ("raise ExceptionGroup('x', [ValueError()])\n", "ExceptionGroup"),
    ("async def f(it):\n    return await anext(it)\n", "anext() (Python 3.10)"),
    ("import sys\nsys.stdlib_module_names\n", "sys.stdlib_module_names"),
])
def test_the_scanner_finds_what_python_3_9_lacks(code: str, needle: str) -> None:
    problems = py39_problems(code, "probe.py")
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize("code", [
    "from __future__ import annotations\ndef f(x: int | None, *a: str | bytes) -> list[int] | None:\n"
    "    y: dict[str, int | None] = {}\n    return None\n",
    "isinstance(1, (int, float))\n",
    "flags = 1 | 2\nmode = flags | 4\n",
    "import os\nm = os.O_CREAT | os.O_WRONLY\n",
    "import numpy as np\na = np.zeros(3, np.int8)\nb = a | a\n",
    "merged = {'a': 1} | {'b': 2}\n",  # dict union is 3.9
    "'x'.removeprefix('y')\n",  # 3.9
    "import sys\nif sys.version_info >= (3, 11):\n    import tomllib\nelse:\n    import tomli as tomllib\n",
    "try:\n    import tomllib\nexcept ImportError:\n    import tomli as tomllib\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from typing import TypeAlias\n",
    "import sys\nif sys.version_info >= (3, 10):\n    z = zip([1], [2], strict=True)\n",
    "(5).to_bytes(2, 'little')\nint.from_bytes(b'ab', byteorder='big')\n",
    "x = list(zip([1], [2]))\n",
    "from typing import Optional, Union\nA = Optional[int]\nB = Union[int, str]\n",
])
def test_the_scanner_accepts_what_python_3_9_has(code: str) -> None:
    assert py39_problems(code, "probe.py") == []


def _ruff(path: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                           "--stdin-filename", path, "-"], input=code, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.parametrize("package", DEVICE_PACKAGES)
def test_ruff_lints_the_device_side_as_python_3_9(package: str) -> None:
    """pyproject.toml's per-file-target-version: 3.10+ syntax is an error in device code
    (and UP rules never rewrite into it), the coordinator keeps 3.11."""
    code = "def f(x):\n    match x:\n        case 1:\n            return 1\n    return 0\n"
    device = _ruff(f"{package}/probe.py", code)
    assert device.returncode == 1 and "Python 3.9" in device.stdout, device.stdout + device.stderr
    assert _ruff("coordinator/probe.py", code).returncode == 0
    # UP007 would rewrite Optional[X] into X | None at run time for py310+; not here
    alias = "from typing import Optional\n\nNumber = Optional[int]\n"
    assert _ruff(f"{package}/probe.py", alias).returncode == 0
    assert "UP" in _ruff("coordinator/probe.py", alias).stdout


def test_ruff_lints_as_python_3_9_exactly_what_runs_on_it() -> None:
    table = _pyproject()["tool"]["ruff"]["per-file-target-version"]
    assert set(table.values()) == {"py39"}
    assert set(table) == {f"{p}/**" for p in DEVICE_PACKAGES} | set(_runs_on_39())


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_floors_say_the_same() -> None:
    import edge_client
    import hw_profiles

    project = _pyproject()["project"]
    assert project["requires-python"] == ">={}.{}".format(*edge_client.PYTHON_FLOOR)
    assert hw_profiles.PYTHON_FLOOR == edge_client.PYTHON_FLOOR == (3, 9)
    assert "Programming Language :: Python :: 3.9" in project["classifiers"]
    deps = project["dependencies"]
    assert "tomli>=2.0; python_version < '3.11'" in deps
    # the coordinator extra installs nothing below 3.11 (torch 2.13 has no 3.9 wheels):
    # `fedbit` says why instead of pip failing on torch
    for req in project["optional-dependencies"]["coordinator"]:
        assert req.endswith("; python_version >= '3.11'"), req
    for p in hw_profiles.list_profiles():
        assert p.python_floor >= edge_client.PYTHON_FLOOR


def test_the_coordinator_refuses_an_older_python_by_name() -> None:
    """coordinator/__init__.py under a Python that says it is 3.9: an ImportError naming
    3.11 for an import, one line (no traceback) for the ``fedbit`` command."""
    init = (ROOT / "coordinator" / "__init__.py").read_text(encoding="utf-8")
    def run(argv0: str) -> subprocess.CompletedProcess[str]:
        probe = (f"import sys\nsys.version_info = (3, 9, 2, 'final', 0)\nsys.argv = [{argv0!r}]\n"
                 f"exec(compile({init!r}, 'coordinator/__init__.py', 'exec'), {{}})\n")
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)

    as_import = run("python")
    assert as_import.returncode == 1
    assert "ImportError: the fedbit coordinator needs Python >= 3.11, this is Python 3.9.2" in as_import.stderr
    as_cli = run("/venv/bin/fedbit")
    assert as_cli.returncode == 1 and "Traceback" not in as_cli.stderr
    assert as_cli.stderr.startswith("fedbit: error: the fedbit coordinator needs Python >= 3.11"), as_cli.stderr
    assert "fedbit-edge" in as_cli.stderr
