"""``fedbit-edge doctor``: is this machine ready to be a fleet device?

Each check returns a :class:`Check` (one verdict line); the command exits non-zero when
any fails (a warning does not fail). Checks that need a broker run only when one is given.
The profile says what it assumes (``image``, ``python``, ``arch``, ``trainer``) and the
checks hold the machine to it.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hw_profiles import HardwareProfile

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

    from edge_client.transport.base import Transport

#: a clock before this is certainly wrong (a Pi without a real-time clock boots in 1970,
#: and TLS then refuses every certificate as not yet valid)
SANE_EPOCH = 1_735_689_600  # 2025-01-01T00:00:00Z
#: what an Int8 device process needs at its peak (benchmarks/train_throughput.py, fedshift_cnn)
TRAINING_RAM_MB = 200


#: ``platform.machine()`` spellings of the profiles' ``arch``
ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64"}
#: 32-bit ARM kernels: a 64-bit board running a 32-bit OS (numba has no wheels for it)
ARM32 = ("armv6l", "armv7l", "armv8l")


@dataclass(frozen=True)
class Check:
    """One verdict: ``ok`` False fails the doctor; ``warn`` marks a passing check that
    deserves a look (printed WARN, not counted as a failure)."""

    name: str
    ok: bool
    detail: str
    warn: bool = False

    def line(self) -> str:
        verdict = "FAIL" if not self.ok else ("WARN" if self.warn else "PASS")
        return f"{verdict}  {self.name}: {self.detail}"


def check_python(profile: HardwareProfile, version: tuple[int, ...] | None = None) -> Check:
    """Python >= the profile's ``python`` (the oldest its images ship; at least 3.9)."""
    v = tuple(sys.version_info[:3]) if version is None else tuple(version)
    ok = v[:2] >= profile.python_floor
    detail = f"{'.'.join(map(str, v))} (the {profile.name} profile needs >= {profile.python}"
    if not ok:  # say which image brings it
        detail += f"; {profile.image or 'a newer image'}"
    return Check("python", ok, detail + ")")


def os_name(os_release: str = "/etc/os-release") -> str:
    """``PRETTY_NAME`` of ``os_release`` (e.g. ``Debian GNU/Linux 11 (bullseye)``), else
    ``platform.platform()``."""
    try:
        for line in Path(os_release).read_text(encoding="utf-8").splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except (OSError, UnicodeDecodeError):
        pass
    return platform.platform()


def check_image(profile: HardwareProfile, machine: str | None = None, os_release: str = "/etc/os-release") -> Check:
    """The machine is the profile's ``arch``: a FAIL for a 32-bit ARM OS where the profile
    is 64-bit, a WARN for any other mismatch (a profile tried on a workstation)."""
    machine = platform.machine() if machine is None else machine
    arch = ARCH_ALIASES.get(machine.lower(), machine.lower())
    want = f"; the profile assumes {profile.image}" if profile.image else ""
    detail = f"{os_name(os_release)}, {machine}{want}"
    if arch == profile.arch:
        return Check("image", True, detail)
    if arch in ARM32 and profile.arch == "aarch64":
        return Check("image", False, f"{detail}: a 32-bit OS; install the 64-bit image")
    return Check("image", True, f"{detail}; this machine is not {profile.arch}", warn=True)


def check_torch(profile: HardwareProfile) -> Check:
    """A float (``trainer = "torch"``) profile trains with torch: it must import."""
    try:
        import torch
    except Exception as exc:  # missing, or a wheel for another CUDA/Python
        return Check("torch", False, f"the {profile.name} profile trains in float32 with torch, "
                                     f"which does not import ({type(exc).__name__}: {exc})")
    return Check("torch", True, f"{torch.__version__}")


def check_gpu(profile: HardwareProfile) -> Check:
    """The CUDA engine (a profile whose ``engine`` is ``cuda`` or ``auto``): the GPU, its
    compute capability, driver, toolkit, and whether the kernels compile for it (the
    profile's bitwidth, to PTX). No usable GPU fails ``cuda`` and warns ``auto`` (its
    steps then run on the CPU)."""
    from edge_client.intnn.cuda.probe import describe

    info = describe()
    if not info["usable"]:
        return Check("gpu", profile.engine != "cuda",
                     f"none here: {info['why']} (numba-cuda: {info['numba_cuda']}); "
                     + ("the cuda engine cannot run" if profile.engine == "cuda"
                        else "engine auto trains on the CPU"), warn=True)
    if "gpu" not in info:  # the simulator
        return Check("gpu", True, info["why"], warn=True)
    try:
        from edge_client.intnn.cuda.compile import compile_for

        n = compile_for(profile.compute_bits)
        kernels = f"{n} kernels compile for it"
    except Exception as exc:  # noqa: BLE001 - the toolkit's error is the verdict
        return Check("gpu", False, f"{info['gpu']}: the kernels do not compile ({type(exc).__name__}: {exc})")
    return Check("gpu", True, f"{info['gpu']}, compute capability {info['compute_capability']}, driver "
                              f"{info['driver']}, toolkit {info['toolkit']}, numba-cuda {info['numba_cuda']}; "
                              f"{kernels}")


def check_jit() -> Check:
    """numba compiles, and its cache can be written where numba will write it; the line
    names numba's, llvmlite's and numpy's versions (what a device's figures depend on)."""
    try:
        import llvmlite
        import numba
        import numpy as np

        @numba.njit(cache=False)
        def _twice(a):  # pragma: no cover - compiled
            return a * 2

        if int(_twice(np.int32(21))) != 42:
            return Check("numba", False, "a compiled function returned a wrong value")
    except Exception as exc:  # an install that cannot JIT fails in many ways
        return Check("numba", False, f"cannot compile: {type(exc).__name__}: {exc}")
    import edge_client.intnn.kernels as k

    where = os.environ.get("NUMBA_CACHE_DIR") or str(Path(k.__file__).parent / "__pycache__")
    ok = _writable(Path(where))
    if not ok and not os.environ.get("NUMBA_CACHE_DIR"):
        where = str(Path.home() / ".cache")  # numba's user-wide cache when beside the package is read-only
        ok = _writable(Path(where))
    versions = f"{numba.__version__} (llvmlite {llvmlite.__version__}, numpy {np.__version__})"
    return Check("numba", ok, f"{versions}, compiles; kernel cache {where} "
                              f"{'writable' if ok else 'NOT writable: every start recompiles (minutes on a Pi)'}")


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d):
            pass
        return True
    except OSError:
        return False


def available_ram_mb(meminfo: str = "/proc/meminfo") -> float | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_ram(profile: HardwareProfile, meminfo: str = "/proc/meminfo") -> Check:
    free = available_ram_mb(meminfo)
    if free is None:
        return Check("memory", True, f"unknown (no {meminfo}); a device process needs ~{TRAINING_RAM_MB} MB")
    need = TRAINING_RAM_MB if profile.is_integer else 600  # torch alone is ~220 MB
    return Check("memory", free >= need, f"{free:.0f} MB available of the profile's {profile.ram_mb} MB; "
                                         f"training needs ~{need} MB")


def check_clock(now: float | None = None) -> Check:
    now = time.time() if now is None else now
    ok = now >= SANE_EPOCH
    return Check("clock", ok, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
                 + ("" if ok else " is before 2025: set the time (NTP), or TLS refuses the broker"))


def check_files(paths: dict[str, str]) -> Check:
    bad = [f"{what} {p}" for what, p in paths.items() if p and not os.access(p, os.R_OK)]
    return Check("tls files", not bad, "readable" if not bad else "cannot read " + ", ".join(bad))


def check_broker(connect: Callable[[float], Transport], timeout: float = 10.0
                 ) -> tuple[Check, Transport | None]:
    """``connect()`` -> a connected transport or an exception."""
    t0 = time.perf_counter()
    try:
        t = connect(timeout)
    except (ConnectionError, OSError) as exc:
        return Check("broker", False, str(exc)), None
    return Check("broker", True, f"connected in {(time.perf_counter() - t0) * 1000:.0f} ms"), t
