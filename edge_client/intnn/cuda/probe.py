"""Can the CUDA engine run here, and on what: :func:`usable` (a yes or no with the reason,
for ``--engine auto``) and :func:`describe` (the GPU, its compute capability, the driver
and toolkit, whether the kernels compile: ``fedbit-edge doctor``)."""

from __future__ import annotations

from typing import Any

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


def _name(gpu: Any) -> str:
    name = gpu.name
    return name.decode() if isinstance(name, bytes) else str(name)


def describe(compile_kernels: bool = True) -> dict[str, Any]:
    """What ``doctor`` reports: ``usable``, ``why``, and where a GPU is found its ``gpu``
    name, ``compute_capability``, ``driver`` and ``toolkit`` (CUDA runtime / NVVM)
    versions, ``numba_cuda`` (the package that is ``numba.cuda``), ``kernels`` ("compiled"
    or the error of compiling them for this GPU)."""
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
    if compile_kernels:
        try:
            compile_engine(tuple(gpu.compute_capability))
            out["kernels"] = "compiled"
        except Exception as exc:  # noqa: BLE001 - reported, not raised: doctor's verdict
            out["kernels"] = f"failed: {type(exc).__name__}: {exc}"
    return out


def _version(get: Any) -> str:
    try:
        v = get()
    except Exception as exc:  # noqa: BLE001 - reported as unknown
        return f"unknown ({type(exc).__name__})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def compile_engine(cc: tuple[int, int], model: str = "digits_cnn") -> int:
    """Compile every kernel a training step of ``model`` runs (Int6, Int8, Int16) to PTX for
    compute capability ``cc``, without running them; returns how many were compiled."""
    from edge_client.intnn.cuda import device as dev

    previous = dev.mode()
    record = dev.compile_only((cc,))
    try:
        exercise(model)
    finally:
        dev.set_mode(previous)
    return len(record)


def exercise(model: str = "digits_cnn", bits: tuple[int, ...] = (6, 8, 16)) -> None:
    """A forward and a training step (with the FedProx term, and each loss) of ``model`` at
    each of ``bits`` on the CUDA engine: with :func:`device.compile_only`, every kernel
    variant a round runs, compiled."""
    import numpy as np

    from edge_client.intnn import IntModel, init_int
    from edge_client.intnn.ops import Regularizer
    from firmware_models import resolve_model

    spec = resolve_model(model)
    for b in bits:
        for loss in ("sse", "ce"):
            m = IntModel(spec, b, loss=loss, backend="cuda")
            m.load_int(init_int(spec, 0, b))
            ws = m.workspace(2)
            m.forward(ws, 2)
            reg = Regularizer(anchor=[w.copy() for w in m.w], step_g=[np.zeros(s, np.int32) for s in m.internal_shapes],
                              mu_q=1, alpha_q=1, d_shift=1, shift=3)
            for r in (None, reg):
                m.train_step(ws, np.zeros(2, np.int64), 2, 3, 0, 0, r)
            m.close()
