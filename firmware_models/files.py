"""A user's own model from a file: a TOML list of layers, or a Python file defining a
:class:`ModelSpec` (docs/experiments.md#models-bundled-and-your-own shows both).

TOML: top-level ``name`` (default: the file's stem), ``input`` ([C, H, W] or [F]),
``classes`` (default: what the last layer outputs), ``description``, ``init`` (wage | he),
and ``[[layers]]`` tables with a ``type`` (a kind's ``file_type`` or alias,
``firmware_models.layers``) and that kind's keys (``file_keys``); every layer may give a
``name`` (default ``conv1``, ``fc1``, ..., numbered per kind) and ``in`` where the kind
reads an input size (checked when given). Python: a module that defines ``MODEL`` (or
exactly one module-level ``ModelSpec``); loading it runs it, so only files the user
names are loaded (a device never loads a path a coordinator announces).

Errors are :class:`SpecError` naming the file and, for a layer, its index and name.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import Any

from firmware_models.errors import SpecError
from firmware_models.layers import LAYER_TYPES, REQUIRED, SpecLayer
from firmware_models.spec import ModelSpec

try:
    import tomllib as _toml
except ImportError:  # Python < 3.11 (a device): the tomli backport, when installed
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ImportError:
        _toml = None  # type: ignore[assignment]

#: the file name endings that make a model reference a file
MODEL_FILE_SUFFIXES = (".toml", ".py")

_TOP_KEYS = {"name", "input", "classes", "description", "layers", "init"}
#: a model file's layer ``type`` -> its kind, aliases included (firmware_models.layers)
_LAYER_TYPES: dict[str, type[SpecLayer]] = {cls.file_type: cls for cls in LAYER_TYPES.values()}
_ALIASES = {alias: cls.file_type for cls in LAYER_TYPES.values() for alias in cls.file_aliases}

def is_model_file(ref: str) -> bool:
    """Whether a model reference names a file (``*.toml`` / ``*.py``) rather than a zoo model."""
    return isinstance(ref, str) and ref.endswith(MODEL_FILE_SUFFIXES)


def load_model_file(path: str, reserved: tuple[str, ...] = ()) -> ModelSpec:
    """The :class:`ModelSpec` a TOML or Python file describes (see the module docstring).

    ``reserved``: names the spec may not take (the zoo's). SpecError naming the file (and
    the layer) for anything wrong.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SpecError(f"model file {path}: not found")
    if path.endswith(".toml"):
        spec = _from_toml(path)
    elif path.endswith(".py"):
        spec = _from_python(path)
    else:
        raise SpecError(f"model file {path}: expected a .toml or .py file")
    if spec.name in reserved:
        raise SpecError(f"model file {path}: name {spec.name!r} is a bundled model's; choose another")
    return spec


# ----------------------------------------------------------------------------- TOML


def _from_toml(path: str) -> ModelSpec:
    if _toml is None:
        raise SpecError(f"model file {path}: reading TOML needs Python >= 3.11 or the tomli package")
    try:
        with open(path, "rb") as fh:
            table = _toml.load(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"model file {path}: cannot read it ({exc})") from None
    except _toml.TOMLDecodeError as exc:
        raise SpecError(f"model file {path}: not valid TOML ({exc})") from None
    return spec_from_table(table, path)


def spec_from_table(table: Mapping[str, Any], source: str = "<model>") -> ModelSpec:
    """A :class:`ModelSpec` from a TOML-shaped table (see the module docstring)."""
    unknown = sorted(set(table) - _TOP_KEYS)
    if unknown:
        raise SpecError(f"model file {source}: unknown key {unknown[0]!r} (known: {sorted(_TOP_KEYS)})")
    name = table.get("name", os.path.splitext(os.path.basename(source))[0])
    if not isinstance(name, str) or not name:
        raise SpecError(f"model file {source}: name must be a non-empty string")
    shape = table.get("input")
    if (not isinstance(shape, list) or not 1 <= len(shape) <= 3
            or not all(_is_int(d) and d >= 1 for d in shape)):
        raise SpecError(f"model file {source}: input must be [C, H, W] or [F] of positive integers, "
                        f"got {shape!r}")
    layers_raw = table.get("layers")
    if not isinstance(layers_raw, list) or not layers_raw:
        raise SpecError(f"model file {source}: layers must be a non-empty list of tables ([[layers]])")
    counters: dict[str, int] = {}
    layers = []
    current: tuple[int, ...] = tuple(int(d) for d in shape)
    for i, raw in enumerate(layers_raw):
        layer = _layer(raw, i, current, counters, source)
        try:
            current = layer.output_shape(current)
        except SpecError as exc:
            raise SpecError(f"model file {source}: layers[{i}] ({layer.name}): {exc}") from None
        layers.append(layer)
    if len(current) != 1:
        raise SpecError(f"model file {source}: the last layer outputs {list(current)}, not [classes] "
                        f"(end with a linear layer)")
    classes = table.get("classes", current[0])
    if not _is_int(classes) or classes < 2:
        raise SpecError(f"model file {source}: classes must be an integer >= 2, got {classes!r}")
    if classes != current[0]:
        raise SpecError(f"model file {source}: layers[{len(layers) - 1}] ({layers[-1].name}) outputs "
                        f"{current[0]} values but classes = {classes}")
    description = table.get("description", f"from {os.path.basename(source)}")
    if not isinstance(description, str):
        raise SpecError(f"model file {source}: description must be a string")
    init = table.get("init", "wage")
    if not isinstance(init, str):
        raise SpecError(f"model file {source}: init must be a string")
    try:
        return ModelSpec(name, tuple(int(d) for d in shape), tuple(layers), int(classes), description, init)
    except SpecError as exc:
        raise SpecError(f"model file {source}: {exc}") from None


def _layer(raw: object, i: int, current: tuple[int, ...], counters: dict[str, int], source: str
           ) -> SpecLayer:
    where = f"model file {source}: layers[{i}]"
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a table with a type, got {raw!r}")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise SpecError(f"{where}: needs type = one of {sorted(_LAYER_TYPES)}")
    kind = _ALIASES.get(kind.lower(), kind.lower())
    if kind not in _LAYER_TYPES:
        raise SpecError(f"{where}: type {raw.get('type')!r} is not one of {sorted(_LAYER_TYPES)}")
    cls = _LAYER_TYPES[kind]
    required = tuple(k for k, v in cls.file_keys.items() if v is REQUIRED)
    optional = {k: v for k, v in cls.file_keys.items() if v is not REQUIRED}
    prefix = cls.name_prefix
    counters[prefix] = counters.get(prefix, 0) + 1
    name = raw.get("name", cls.default_name(counters[prefix]))
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: name must be a non-empty string")
    where = f"{where} ({kind} {name})"
    unknown = sorted(set(raw) - {"type", "name", *required, *optional})
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r} (known: {sorted({*required, *optional})})")
    values: dict[str, Any] = dict(optional)
    for key in required:
        if key not in raw:
            raise SpecError(f"{where}: needs {key!r}")
    values.update({k: v for k, v in raw.items() if k not in ("type", "name")})
    for key, v in values.items():
        if v is None and optional.get(key, REQUIRED) is None:  # "in", a pool's "stride"
            continue
        low = 0 if key == "padding" else 1
        if not _is_int(v) or v < low:
            raise SpecError(f"{where}: {key} must be an integer >= {low}, got {v!r}")
    return cls.from_file(name, values, current, where)

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- Python


def _from_python(path: str) -> ModelSpec:
    module_name = "fedbit_user_model_" + str(abs(hash(os.path.abspath(path))))
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"model file {path}: cannot load it as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SpecError as exc:
        raise SpecError(f"model file {path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's code: say where it failed
        line = ""
        tb = exc.__traceback__
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
                line = f" (line {tb.tb_lineno})"
            tb = tb.tb_next
        raise SpecError(f"model file {path}{line}: {type(exc).__name__}: {exc}") from None
    finally:
        sys.modules.pop(module_name, None)
    found = getattr(module, "MODEL", None)
    if found is None:
        specs = [v for k, v in vars(module).items() if isinstance(v, ModelSpec) and not k.startswith("_")]
        if len(specs) != 1:
            raise SpecError(f"model file {path}: define MODEL = ModelSpec(...) "
                            f"(found {len(specs)} module-level ModelSpec values)")
        found = specs[0]
    if not isinstance(found, ModelSpec):
        raise SpecError(f"model file {path}: MODEL is a {type(found).__name__}, not a ModelSpec")
    return found
