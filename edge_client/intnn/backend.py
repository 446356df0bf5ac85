"""Where an :class:`~edge_client.intnn.model.IntModel`'s kernels run: the
:class:`Backend` seam, and :class:`CpuBackend`, the Numba CPU engine (its VNNI kernels
where the CPU has them, its passes split over threads: :mod:`.step`, :mod:`.workspace`,
:mod:`.parallel`). A backend runs each layer kind through the class registered for it
(``edge_client.intnn.layers``: ``implements(spec type, backend=name)``), so a backend is
added a layer kind at a time; :data:`BACKENDS` names them (``cuda``: the GPU engine of
``edge_client.intnn.cuda``, imported when a model asks for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn import step
from edge_client.intnn.allocation import build_workspace
from edge_client.intnn.parallel import Splitter
from edge_client.intnn.workspace import Regularizer, Workspace

if TYPE_CHECKING:  # pragma: no cover
    from edge_client.intnn.model import IntModel


class Backend(Protocol):
    """A model's compute: its buffers, its forward pass and its training step. The
    weights are the model's (numpy arrays, the engine's layout); a backend that keeps
    copies elsewhere refreshes them in the layers' ``ternary_copies``."""

    name: str      # the registry's backend name of the layer classes it runs
    threads: int   # cores a step uses

    def workspace(self, model: IntModel, capacity: int, train: bool) -> Workspace:
        """Buffers for batches of up to ``capacity`` samples."""
        ...

    def forward(self, model: IntModel, ws: Workspace, n: int) -> np.ndarray:
        """The logits [n, classes] of ``ws.x[:n]``."""
        ...

    def train_step(self, model: IntModel, ws: Workspace, y: np.ndarray, n: int, lr_log2: int,
                   seed: int, step_count: int, reg: Regularizer | None) -> int:
        """One SGD step on ``ws.x[:n]``; the integer loss sum."""
        ...

    def sync(self, model: IntModel) -> None:
        """Bring the model's arrays of weights up to date where the backend's copies
        changed (the model calls it before it reads them)."""
        ...

    def close(self) -> None:
        """Release what the backend holds (threads, device memory)."""
        ...


class CpuBackend:
    """The Numba engine on ``threads`` cores (results do not depend on the count)."""

    name = "cpu"

    def __init__(self, threads: int = 1) -> None:
        self.splitter = Splitter(threads)

    @property
    def threads(self) -> int:
        return self.splitter.threads

    def workspace(self, model: IntModel, capacity: int, train: bool) -> Workspace:
        return build_workspace(model, model.spec, model.ops, self.threads, capacity, train)

    def forward(self, model: IntModel, ws: Workspace, n: int) -> np.ndarray:
        return step.forward(model, ws, n, self.splitter)

    def train_step(self, model: IntModel, ws: Workspace, y: np.ndarray, n: int, lr_log2: int,
                   seed: int, step_count: int, reg: Regularizer | None) -> int:
        return step.train_step(model, ws, y, n, lr_log2, seed, step_count, reg, self.splitter)

    def sync(self, model: IntModel) -> None:
        """Nothing to do: the kernels update the model's arrays."""

    def close(self) -> None:
        self.splitter.close()


def _cuda(threads: int) -> Backend:
    """The CUDA engine (``edge_client.intnn.cuda``; imported only when asked for)."""
    from edge_client.intnn.cuda.backend import CudaBackend

    return CudaBackend(threads)


#: backend name -> its factory (threads -> Backend)
BACKENDS: dict[str, Callable[[int], Backend]] = {"cpu": CpuBackend, "cuda": _cuda}


def make_backend(name: str, threads: int = 1) -> Backend:
    """The named backend on ``threads`` cores; ConfigError for an unknown name."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise ConfigError(f"unknown engine backend {name!r}; known: {sorted(BACKENDS)}")
    return factory(threads)
