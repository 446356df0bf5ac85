"""``fedbit-edge doctor``: is this machine ready to be a fleet device?

Each check returns a :class:`Check` (one verdict line); the command exits non-zero when
any fails. Checks that need a broker run only when one is given.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: a clock before this is certainly wrong (a Pi without a real-time clock boots in 1970,
#: and TLS then refuses every certificate as not yet valid)
SANE_EPOCH = 1_735_689_600  # 2025-01-01T00:00:00Z
#: what an Int8 device process needs at its peak (benchmarks/train_throughput.py, fedshift_cnn)
TRAINING_RAM_MB = 200


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def check_python() -> Check:
    v = sys.version_info
    return Check("python", v >= (3, 11), f"{v.major}.{v.minor}.{v.micro} (needs >= 3.11)")


def check_jit() -> Check:
    """numba compiles, and its cache can be written where numba will write it."""
    try:
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
    return Check("numba", ok, f"{numba.__version__}, compiles; kernel cache {where} "
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


def check_ram(profile: Any, meminfo: str = "/proc/meminfo") -> Check:
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


def check_broker(connect: Any, timeout: float = 10.0) -> tuple[Check, Any]:
    """``connect()`` -> a connected transport or an exception."""
    t0 = time.perf_counter()
    try:
        t = connect(timeout)
    except (ConnectionError, OSError) as exc:
        return Check("broker", False, str(exc)), None
    return Check("broker", True, f"connected in {(time.perf_counter() - t0) * 1000:.0f} ms"), t
