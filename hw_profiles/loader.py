"""Load and validate hardware profiles (docs/device.md#hardware-profiles).

A profile is a flat TOML table with exactly the fields of :class:`HardwareProfile`.
Unknown keys, missing keys, wrong types and out-of-range values raise
:class:`ProfileError` naming the file and the key.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9/3.10 (the device side's floor is 3.9): the same parser from PyPI
    import tomli as tomllib

#: the oldest Python the device side runs on; mirrors ``edge_client.PYTHON_FLOOR`` (a test
#: keeps the two equal). A profile's ``python`` may not be older.
PYTHON_FLOOR = (3, 9)


class ProfileError(ValueError):
    """A profile file is missing, unreadable or invalid; the message names file and key.

    ``edge_client.errors.ConfigError`` is the SDK's general config error; this package
    imports only the SDK's codec table, so callers that want one type catch ``ValueError``.
    """


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind.

    Units: ``ram_mb`` MiB; ``uplink_kbps``/``downlink_kbps`` kilobits per second;
    ``latency_ms`` one-way milliseconds; ``loss_rate`` probability a message is lost;
    ``relative_speed`` training speed relative to the ``desktop`` profile (1.0).
    ``compute_bits`` is 2..16 for integer devices (``trainer = "int"``) and 32 for float
    devices (``trainer = "torch"``). ``codec``/``codec_bits`` pick the uplink codec;
    ``kmeans_method`` (optional, ``"fast"`` by default) the K-means uplink's method:
    ``"fast"`` (optimal 1-D MSE) or ``"authors"`` (the FedShift code's random-init Lloyd).
    ``threads`` (optional, 1 by default; 1..256): the cores an integer device's training
    step uses (its results do not depend on it; the emulator runs every emulated device
    on one thread whatever its profile says).

    What the profile assumes of the device's software (optional keys): ``image``, the OS
    image(s) it was written for (``"Raspberry Pi OS (64-bit) bookworm or bullseye"``), and
    ``python``, the oldest Python those images ship (``"3.9"``, at least ``PYTHON_FLOOR``).
    ``fedbit-edge doctor --profile NAME`` checks the machine against them: Python >=
    ``python``, the machine is ``arch``, and (for ``trainer = "torch"``) torch imports.
    ``engine`` (optional, ``"cpu"`` by default): where an integer device's training steps
    run, ``"cpu"``, ``"cuda"`` (its GPU, ``edge_client.intnn.cuda``; the same results) or
    ``"auto"`` (the GPU when the CUDA engine can run there, else the CPU); a float device
    trains on the CPU (``"cpu"``).
    """

    name: str
    arch: str
    compute_bits: int
    trainer: str
    codec: str
    codec_bits: int
    ram_mb: int
    uplink_kbps: float
    downlink_kbps: float
    latency_ms: float
    loss_rate: float
    relative_speed: float
    notes: str = ""
    kmeans_method: str = "fast"
    threads: int = 1
    image: str = ""
    python: str = "3.9"
    engine: str = "cpu"

    @property
    def is_integer(self) -> bool:
        return self.trainer == "int"

    @property
    def python_floor(self) -> tuple[int, int]:
        """``python`` as ``(major, minor)``: what ``fedbit-edge doctor`` requires."""
        major, minor = self.python.split(".")
        return int(major), int(minor)


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(HardwareProfile))
_OPTIONAL = {"notes", "kmeans_method", "threads", "image", "python", "engine"}
ENGINES = ("cpu", "cuda", "auto")
MAX_THREADS = 256
KMEANS_METHODS = ("fast", "authors")


def profile_dir() -> Path:
    """The folder of the bundled profiles."""
    return Path(__file__).resolve().parent / "profiles"


def _check(where: str, key: str, value: Any, kind: type, lo: float | None = None,
           hi: float | None = None, lo_open: bool = False) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ProfileError(f"{where}: key {key!r} must be {kind.__name__}, got {type(value).__name__}")
    if kind is float and not math.isfinite(value):
        raise ProfileError(f"{where}: key {key!r} must be finite, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ProfileError(f"{where}: key {key!r} = {value} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise ProfileError(f"{where}: key {key!r} = {value} must be <= {hi}")
    return value


def _check_codec(where: str, v: dict[str, Any], trainer: str, compute_bits: int) -> tuple[str, int]:
    """``codec``/``codec_bits`` against the codec table (:data:`edge_client.codecs.CODECS`,
    the codec classes' own names, widths and rules)."""
    from edge_client.codecs import CODECS

    name = _check(where, "codec", v["codec"], str)
    if name not in CODECS:
        raise ProfileError(f"{where}: key 'codec' = {name!r} is not one of {sorted(CODECS)}")
    codec = CODECS[name]
    lo, hi = codec.bits_range
    bits = _check(where, "codec_bits", v["codec_bits"], int)
    if not lo <= bits <= hi:
        raise ProfileError(f"{where}: key 'codec_bits' = {bits} out of range {lo}..{hi} for {name}")
    if codec.integer_only and trainer != "int":
        raise ProfileError(f"{where}: key 'codec' = {name!r} needs an integer device (trainer = 'int')")
    why = codec.bits_problem(bits, compute_bits)
    if why:
        raise ProfileError(f"{where}: key 'codec_bits' = {bits} {why} for codec {name!r}")
    return name, bits


def parse_profile(table: dict[str, Any], where: str = "<profile>") -> HardwareProfile:
    """Validate a parsed TOML table; ``where`` names the source in errors."""
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ProfileError(f"{where}: unknown key {unknown[0]!r} (valid keys: {', '.join(FIELDS)})")
    missing = [k for k in FIELDS if k not in table and k not in _OPTIONAL]
    if missing:
        raise ProfileError(f"{where}: missing key {missing[0]!r}")
    v = dict(table)
    name = _check(where, "name", v["name"], str)
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
        raise ProfileError(f"{where}: key 'name' = {name!r} must be 1-64 characters [A-Za-z0-9._-]")
    _check(where, "arch", v["arch"], str)
    bits = _check(where, "compute_bits", v["compute_bits"], int, 2, 32)
    if not (bits <= 16 or bits == 32):
        raise ProfileError(f"{where}: key 'compute_bits' = {bits} must be 2..16 or 32")
    trainer = _check(where, "trainer", v["trainer"], str)
    if trainer not in ("int", "torch"):
        raise ProfileError(f"{where}: key 'trainer' = {trainer!r} must be 'int' or 'torch'")
    if (trainer == "torch") != (bits == 32):
        raise ProfileError(
            f"{where}: key 'trainer' = {trainer!r} does not fit compute_bits = {bits} "
            "(integer devices use 'int' with 2..16 bits, float devices 'torch' with 32)"
        )
    codec, codec_bits = _check_codec(where, v, trainer, bits)
    kmeans_method = _check(where, "kmeans_method", v.get("kmeans_method", "fast"), str)
    if kmeans_method not in KMEANS_METHODS:
        raise ProfileError(f"{where}: key 'kmeans_method' = {kmeans_method!r} must be one of "
                           f"{list(KMEANS_METHODS)}")
    engine = _check(where, "engine", v.get("engine", "cpu"), str)
    if engine not in ENGINES:
        raise ProfileError(f"{where}: key 'engine' = {engine!r} must be one of {list(ENGINES)}")
    if engine != "cpu" and trainer != "int":
        raise ProfileError(f"{where}: key 'engine' = {engine!r}: a float device (trainer = 'torch') "
                           "trains on the CPU; the cuda engine is the integer one")
    python = _check(where, "python", v.get("python", "3.9"), str)
    parts = python.split(".")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 3 for p in parts):
        raise ProfileError(f"{where}: key 'python' = {python!r} must be MAJOR.MINOR, e.g. \"3.9\"")
    if (int(parts[0]), int(parts[1])) < PYTHON_FLOOR:
        floor = ".".join(map(str, PYTHON_FLOOR))
        raise ProfileError(f"{where}: key 'python' = {python!r}: fedbit's device side needs Python "
                           f">= {floor} (an image with an older Python is not supported)")
    return HardwareProfile(
        name=name,
        arch=v["arch"],
        compute_bits=bits,
        trainer=trainer,
        codec=codec,
        codec_bits=codec_bits,
        ram_mb=_check(where, "ram_mb", v["ram_mb"], int, 16, 1 << 24),
        uplink_kbps=_check(where, "uplink_kbps", v["uplink_kbps"], float, 0, 1e8, lo_open=True),
        downlink_kbps=_check(where, "downlink_kbps", v["downlink_kbps"], float, 0, 1e8, lo_open=True),
        latency_ms=_check(where, "latency_ms", v["latency_ms"], float, 0, 600_000),
        loss_rate=_check(where, "loss_rate", v["loss_rate"], float, 0, 0.99),
        relative_speed=_check(where, "relative_speed", v["relative_speed"], float, 0, 1e4, lo_open=True),
        notes=_check(where, "notes", v.get("notes", ""), str),
        kmeans_method=kmeans_method,
        threads=_check(where, "threads", v.get("threads", 1), int, 1, MAX_THREADS),
        image=_check(where, "image", v.get("image", ""), str),
        python=f"{int(parts[0])}.{int(parts[1])}",
        engine=engine,
    )


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a bundled profile by name (``"raspberry-pi-4"``) or any TOML file by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        bundled = profile_dir() / f"{name_or_path}.toml"
        if not bundled.is_file():
            known = ", ".join(p.stem for p in sorted(profile_dir().glob("*.toml")))
            raise ProfileError(f"unknown profile {str(name_or_path)!r}; bundled: {known}")
        path = bundled
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: invalid TOML ({exc})") from None
    return parse_profile(table, str(path))


def list_profiles() -> list[HardwareProfile]:
    """Every bundled profile, sorted by name."""
    return [load_profile(p) for p in sorted(profile_dir().glob("*.toml"))]
