"""The dependency rules of docs/architecture.md#dependency-rules, enforced
statically and at run time: the device side never imports the coordinator or torch, the
coordinator uses only the device SDK's library, its wings (round core, ``ops``,
``emulation``, ``cli``) depend one way, no import cycle anywhere, and no module or
folder grows past its size limit."""

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


#: package -> what it may import of the device SDK: a profile names an uplink codec, so the
#: profiles read the codec table (the codec classes' names, widths and rules)
SDK_FOR = {"firmware_models": set(), "hw_profiles": {"edge_client.codecs"}}


@pytest.mark.parametrize("package", ["firmware_models", "hw_profiles"])
def test_specs_and_profiles_import_neither_sdk_nor_server(package: str) -> None:
    bad = [(str(f.relative_to(ROOT)), m) for f in _files(package) for m, _ in _imports(f)
           if _root(m) in {"edge_client", "coordinator"} and m not in SDK_FOR[package]]
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
#: ``connection`` and ``logs``: the broker/TLS/logging options and log format both command
#: lines share; ``secagg``: secure aggregation's primitives and encoding, both sides'
COORDINATOR_MAY_USE = {"errors", "protocol", "hparams", "codecs", "intnn", "trainers", "data",
                       "transport", "auth", "connection", "logs", "secagg"}
#: the emulator's devices, by design: emulator.py makes their configs, worker.py runs their
#: real runtimes
RUNS_DEVICES = {"coordinator/emulation/fleet_plan.py", "coordinator/emulation/worker.py"}


def test_coordinator_uses_only_the_device_sdk_library() -> None:
    """docs/architecture.md#dependency-rules: ``coordinator`` may import ``edge_client``'s
    library modules, never its application layer (``runtime``, ``cli``), except the
    emulator; checked for every import statement, function-level ones included."""
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


# --------------------------------------------------------------------------- the module graph

PACKAGES = ("edge_client", "coordinator", "firmware_models", "hw_profiles")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (every import statement, function-level ones
    included, ``if TYPE_CHECKING:`` blocks excluded); ``from a.b import c`` points at
    ``a.b.c`` when that is a module, else at ``a.b``."""
    files = {_module_name(f): f for pkg in PACKAGES for f in _files(pkg)}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        tree = ast.parse(f.read_text(encoding="utf-8"))
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        out: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in files:
                        out.add(full)
                    elif node.module in files:
                        out.add(node.module)
        graph[mod] = out - {mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_anywhere() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _wing(module: str) -> str:
    """The coordinator's wing of a module: ``core`` (the top level and ``strategies``),
    ``ops``, ``emulation`` or ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ("ops", "emulation", "cli") else "core"


#: wing -> the wings it may import from
WINGS_MAY_USE = {"core": {"core", "ops"}, "ops": {"core", "ops"}, "emulation": {"core", "ops", "emulation"},
                 "cli": {"core", "ops", "emulation", "cli"}}


def test_the_coordinators_wings_depend_one_way() -> None:
    """The round core and operations never reach into the research harness or the command
    line; the harness never into the command line."""
    bad = [(m, d) for m, deps in _graph().items() if m.startswith("coordinator")
           for d in deps if d.startswith("coordinator.") and _wing(d) not in WINGS_MAY_USE[_wing(m)]]
    assert not bad


def test_module_and_folder_sizes() -> None:
    """No module over 600 lines; at most 14 modules at the coordinator's top level."""
    long = [(str(f.relative_to(ROOT)), n) for pkg in PACKAGES + ("benchmarks", "experiments")
            for f in sorted((ROOT / pkg).rglob("*.py")) if (n := len(f.read_text(encoding="utf-8").splitlines())) > 600]
    assert not long
    top = sorted(p.name for p in (ROOT / "coordinator").glob("*.py"))
    assert len(top) <= 14, top


# --------------------------------------------------------------------------- layer kinds

#: where a layer kind may be named in a type test or a comparison: its own modules
LAYER_MODULES = ("firmware_models/layers/", "edge_client/intnn/layers/")
#: modules still dispatching on layer kinds, each with the reason it is allowed
LAYER_DISPATCH_ALLOWED = {
    # the dequantizer's planes of a linear layer read through a flatten; its owners'
    # module, to move to the layer objects with them
    "coordinator/strategies/prowd_dequantizer/slices.py",
}
#: attributes whose value names a layer kind (``op.kind == "conv"``, ``type(x).__name__``)
KIND_ATTRIBUTES = {"kind", "__name__", "file_type", "layer_type"}


def _layer_kind_names() -> tuple[set[str], set[str]]:
    """(the layer kinds' class names, spec and engine; the strings that name a kind)."""
    from edge_client.intnn.layers import REGISTRY, IntLayer, IntWeightLayer, load_all
    from firmware_models.layers import LAYER_TYPES, SpecLayer, WeightLayer

    load_all()
    generic = {IntLayer, IntWeightLayer, SpecLayer, WeightLayer, object}
    classes = set(LAYER_TYPES)
    for engine in REGISTRY.values():
        classes |= {c.__name__ for c in engine.__mro__ if c not in generic}
    words = {"conv", "pool", "linear", "relu", "flatten"}  # the engine's old op kinds
    for cls in LAYER_TYPES.values():
        words |= {cls.__name__, cls.__name__.lower(), cls.file_type, cls.name_prefix,
                  *cls.file_aliases}
    return classes, words


def _layer_kind_dispatch(tree: ast.AST, classes: set[str], words: set[str]) -> list[int]:
    """Lines that test a value against a layer kind: ``isinstance(x, Conv2d)``,
    ``cls is Linear``, ``op.kind == "conv"``, ``type(x).__name__ in ("ReLU", ...)``."""

    def names_class(node: ast.AST) -> bool:
        if isinstance(node, ast.Tuple):
            return any(names_class(e) for e in node.elts)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("nn", "torch.nn"):
            return False  # torch's modules of the same names
        last = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        return last in classes

    def names_word(node: ast.AST) -> bool:
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return any(names_word(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in words

    def about_kind(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in KIND_ATTRIBUTES

    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                and names_class(node.args[1])):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if (any(names_class(s) for s in sides)
                    or (any(about_kind(s) for s in sides) and any(names_word(s) for s in sides))):
                lines.append(node.lineno)
    return lines


def test_no_layer_kind_dispatch_outside_the_layer_modules() -> None:
    """docs/architecture.md#add-a-layer-kind: a layer kind's knowledge is in its own
    modules (firmware_models/layers/, edge_client/intnn/layers/); everywhere else a layer
    is asked (``layer.has_weights``, ``op.forward_task(...)``), never tested for its kind."""
    classes, words = _layer_kind_names()
    bad = []
    for pkg in PACKAGES + ("benchmarks", "experiments"):
        for f in _files(pkg):
            rel = str(f.relative_to(ROOT))
            if rel.startswith(LAYER_MODULES) or rel in LAYER_DISPATCH_ALLOWED:
                continue
            tree = ast.parse(f.read_text(encoding="utf-8"))
            bad += [f"{rel}:{line}" for line in _layer_kind_dispatch(tree, classes, words)]
    assert not bad, "ask the layer object instead: " + ", ".join(bad)
    assert {"Conv2d", "CpuConv2d", "IntLinear", "AvgPool2d"} <= classes


def test_the_layer_kind_check_finds_dispatch() -> None:
    classes, words = _layer_kind_names()
    code = """
if isinstance(layer, (Conv2d, Linear)): pass
if cls is MaxPool2d: pass
if op.kind == "conv": pass
if type(layer).__name__ in ("ReLU", "Flatten"): pass
if msg.kind == "update" or a.kind == "i32" or layer.has_weights: pass
if isinstance(m, nn.Conv2d | nn.Linear): pass
if isinstance(layer, firmware_models.Linear): pass
"""
    assert _layer_kind_dispatch(ast.parse(code), classes, words) == [2, 3, 4, 5, 8]


# --------------------------------------------------------------------------- codec knowledge


def _strings(node: ast.expr) -> list[str]:
    """The string literals an operand is or lists (``"kmeans"``, ``("int", "ternary")``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [s for elt in node.elts for s in _strings(elt)]
    return []


def _codec_name_comparisons(source: str, names: set[str], shared: set[str]) -> list[str]:
    """Every comparison of a codec name with something (``st.codec == "kmeans"``,
    ``codec in ("int", "ternary")``). Names that are also dtypes, trainers or model variants
    (``shared``: ``"float32"``, ``"int"``) count only where the other side speaks of a
    codec."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for left, right in zip(operands, operands[1:], strict=False):
            for lit, other in ((left, right), (right, left)):
                if any(s in names and (s not in shared or "codec" in ast.unparse(other).lower())
                       for s in _strings(lit)):
                    out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def _codec_names() -> tuple[set[str], set[str]]:
    from edge_client.codecs import CODECS
    from edge_client.protocol import DTYPES, FLOAT_VARIANT, TRAINERS

    names = set(CODECS)
    return names, {n for n in names if n in DTYPES or n in TRAINERS or n == FLOAT_VARIANT}


def test_only_the_codecs_branch_on_a_codec_s_name() -> None:
    """A codec's knowledge lives in its class (``edge_client/codecs/``): nowhere else in
    the packages is a codec's name compared, so a new codec needs no edit elsewhere.
    (Benchmarks, experiments and tests choose codecs by name; they are not scanned.)"""
    names, shared = _codec_names()
    codecs = ROOT / "edge_client" / "codecs"
    bad = []
    for f in (f for pkg in PACKAGES for f in _files(pkg) if codecs not in f.parents):
        text = f.read_text(encoding="utf-8")
        if any(f"{q}{n}{q}" in text for n in names for q in "'\""):  # parse only what quotes a name
            bad += [(str(f.relative_to(ROOT)), hit) for hit in _codec_name_comparisons(text, names, shared)]
    assert not bad


def test_the_codec_name_check_finds_a_branch() -> None:
    names, shared = _codec_names()
    src = ("if st.codec == 'kmeans': pass\nif codec in ('int', 'x'): pass\nif 'danuq' != name: pass\n"
           "if dtype == 'float32' or trainer == 'int' or variant != 'float32': pass\n")
    assert [h.split(":")[0] for h in _codec_name_comparisons(src, names, shared)] == ["line 1", "line 2", "line 3"]
