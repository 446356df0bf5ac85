"""Can the CUDA engine run here, and on what: :func:`usable` (a yes or no with the reason,
for ``--engine auto``) and :func:`describe` (the GPU, its compute capability, the driver
and toolkit: ``fedbit-edge doctor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable

#: the oldest compute capability the engine is built for (numba-cuda's floor with CUDA 12)
MIN_CC = (5, 0)


def usable() -> tuple[bool, str]:
    """``(True, what runs the kernels)`` or ``(False, why not)``; never raises."""
    try:
        from edge_client.intnn.cuda import device as dev
    except Exception as exc:  # noqa: BLE001 - numba's CUDA target failed to import: say why
        return False, f"numba's CUDA target does not import ({type(exc).__name__}: {exc})"
    if dev.mode() == "sim":
        return True, "Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1: the kernels run as Python on the CPU)"
    if dev.mode() == "ptx":
        return True, "compile-only (PTX)"
    try:
        if not dev.cuda.is_available():
            return False, "no CUDA GPU or driver found (numba.cuda.is_available() is False)"
        gpu = dev.cuda.get_current_device()
        cc = tuple(gpu.compute_capability)
    except Exception as exc:  # noqa: BLE001 - a broken driver or toolkit: say why
        return False, f"the CUDA driver or toolkit failed ({type(exc).__name__}: {exc})"
    if cc < MIN_CC:
        return False, f"{_name(gpu)} has compute capability {cc[0]}.{cc[1]} (< {MIN_CC[0]}.{MIN_CC[1]})"
    return True, f"{_name(gpu)} (compute capability {cc[0]}.{cc[1]})"


def choose(engine: str) -> tuple[str, str]:
    """``(backend, the line to say)`` for an integer device asked to train on ``engine``
    (``"cpu" | "cuda" | "auto"``): auto takes the GPU when :func:`usable`, else the CPU and
    says why; ``"cuda"`` where it cannot run raises ConfigError with the reason."""
    from edge_client.errors import ConfigError

    if engine == "cpu":
        return "cpu", "integer engine on the CPU"
    if engine not in ("cuda", "auto"):
        raise ConfigError(f"engine {engine!r} is not 'cpu', 'cuda' or 'auto'")
    ok, why = usable()
    if ok:
        return "cuda", f"integer engine on the GPU: {why}"
    if engine == "cuda":
        raise ConfigError(f"the cuda engine cannot run here: {why}")
    return "cpu", f"integer engine on the CPU (engine auto: {why})"


def _name(gpu: Any) -> str:  # a numba CUDA device (numba ships no type stubs)
    name = gpu.name
    return name.decode() if isinstance(name, bytes) else str(name)


def describe() -> dict[str, Any]:
    """What ``doctor`` reports: ``usable``, ``why``, ``numba_cuda`` (the package that is
    ``numba.cuda``), and where a GPU is found its ``gpu`` name, ``compute_capability``,
    ``driver`` and ``toolkit`` (CUDA runtime) versions (``cuda.compile`` says whether the
    kernels compile for it)."""
    ok, why = usable()
    out: dict[str, Any] = {"usable": ok, "why": why}
    try:
        import importlib.metadata as md

        out["numba_cuda"] = md.version("numba-cuda")
    except Exception:  # noqa: BLE001 - not installed: numba's built-in CUDA target
        out["numba_cuda"] = "not installed (numba's built-in CUDA target)"
    if not ok:
        return out
    from edge_client.intnn.cuda import device as dev

    if dev.mode() != "gpu":
        return out
    gpu = dev.cuda.get_current_device()
    out["gpu"] = _name(gpu)
    out["compute_capability"] = ".".join(map(str, gpu.compute_capability))
    out["driver"] = _version(lambda: dev.cuda.cudadrv.driver.driver.get_version())
    out["toolkit"] = _version(lambda: dev.cuda.runtime.get_version())
    return out


def _version(get: Callable[[], object]) -> str:
    try:
        v = get()
    except Exception as exc:  # noqa: BLE001 - reported as unknown
        return f"unknown ({type(exc).__name__})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
