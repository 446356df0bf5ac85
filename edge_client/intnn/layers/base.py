"""What an integer engine layer is: :class:`IntLayer` (one layer of an
:class:`~edge_client.intnn.model.IntModel` in the engine's layout) and
:class:`IntWeightLayer` (one with integer weights), the registry of their
implementations per backend and spec layer type (:func:`implements`), and the seams
they read: :class:`Numerics` (a model's integer formats) and :class:`ParamPass` (one
weight layer's backward on the CPU backend).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from edge_client.errors import ConfigError
from edge_client.intnn import kernels as K
from edge_client.intnn.parallel import Task
from edge_client.intnn.workspace import Scratch, Workspace

if TYPE_CHECKING:  # pragma: no cover
    from firmware_models.layers.base import SpecLayer, WeightLayer

INT32_LIMIT = (1 << 31) - 1
INT16_LIMIT = (1 << 15) - 1

#: (backend name, spec layer type) -> the engine class that runs that kind there
REGISTRY: dict[tuple[str, type], type[IntLayer]] = {}
#: backend name -> the package of its layer modules (``layers.layer_class`` imports them)
PACKAGES: dict[str, str] = {}


def implements(spec_type: type, backend: str = "cpu") -> Callable[[type[IntLayer]], type[IntLayer]]:
    """Class decorator: the decorated engine class runs ``spec_type`` layers on ``backend``."""
    def register(cls: type[IntLayer]) -> type[IntLayer]:
        REGISTRY[(backend, spec_type)] = cls
        return cls
    return register


class Numerics(Protocol):
    """A model's integer formats at s bits, as its layers' kernels read them."""

    bits: int         # compute bitwidth s
    amax: int         # largest activation 2^(s-1) - 1
    adtype: np.dtype  # activations and quantized errors: int8 (s <= 8) or int16
    wdtype: np.dtype  # stored weights
    wmax: int         # weight clip on the storage grid
    thr: int          # ternary threshold on the storage grid
    conv_impl: str    # "col" | "sparse"


def vnni_dot(model: Numerics) -> bool:
    """Int8 operands: the dot products may run on AVX-512 VNNI (``kernels.VNNI``, read at
    call time)."""
    return K.VNNI and model.amax <= 127


class IntLayer:
    """One layer in the engine's layout: activations NHWC ``(H, W, C)`` or ``[F]``
    (``in_shape``, ``out_shape``, no batch), op ``index`` in ``IntModel.ops``.

    Set when the model is built: ``param`` (index into the weight list, -1 without),
    ``needs_input_error`` (a weight layer comes before it), ``relu_in`` (its input comes
    out of a ReLU through layers that keep that: an error at an input <= 0 is zeroed
    further down, so it need not be computed). Set per workspace (CPU backend):
    ``split`` (its kernels run over the model's threads). ``view``: the output is a view
    of the input; ``split_like_input``: split exactly when the layer before is.
    """

    view: ClassVar[bool] = False
    split_like_input: ClassVar[bool] = False
    #: a max-pool whose backward routes and quantizes the error of the layer before it
    fused_error: bool = False
    vnni: bool = False

    def __init__(self, layer: SpecLayer, index: int, in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...]) -> None:
        self.layer = layer
        self.index = index
        self.in_shape = in_shape
        self.out_shape = out_shape
        self.param = -1
        self.relu = False
        self.needs_input_error = False
        self.relu_in = False
        self.split = False
        #: spec positions of this layer's flat outputs in engine order (a flatten of
        #: [C, H, W] outputs (h, w, c)), or None where the orders agree
        self.order: np.ndarray | None = None

    # structure ----------------------------------------------------------------------

    def link(self, prev: IntLayer | None) -> None:
        """Facts that depend on the layer before (None for the first), once the list is
        built."""

    def relu_out(self, relu_in: bool) -> bool:
        """Whether the output still comes out of a ReLU given whether the input does
        (False unless the layer keeps it: always correct, a skipped zero is an optimization)."""
        return False

    def macs(self) -> int:
        """Multiply-accumulates of one sample's forward (0 without weights)."""
        return 0

    def check(self, model: Numerics) -> None:
        """ConfigError when the kernels cannot run this layer at the model's bits."""

    # CPU backend --------------------------------------------------------------------

    def buffers(self, model: Numerics, n: int, train: bool
                ) -> tuple[dict[str, np.ndarray | None], dict[str, np.ndarray | None], int]:
        """(shared buffers, one thread's scratch, length of the non-zero lists it needs) for
        batches of ``n``; names are :class:`~edge_client.intnn.workspace.Workspace`'s and
        :class:`~edge_client.intnn.workspace.Scratch`'s lists."""
        return {}, {}, 0

    def has_input_error(self) -> bool:
        """Whether training keeps the error at the input in its own buffer (``err_in``)."""
        return True

    def forward_task(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                     n: int) -> tuple[Callable[..., Any], Callable[[int, int, int], Sequence[Any]]] | None:
        """(kernel, args(thread, lo, hi)) of the forward over samples lo..hi, or None when
        the kernel is not split over samples (:meth:`forward` then runs it)."""
        return None

    def forward(self, model: Numerics, ws: Workspace, prev: np.ndarray, out: np.ndarray,
                n: int) -> None:
        """The forward of samples [:n] as one call (``out`` from ``prev``)."""
        raise NotImplementedError(f"{type(self).__name__}: no forward")

    def backward(self, model: Numerics, ws: Workspace, cur: np.ndarray, kq: int, n: int,
                 front: ParamPass | None) -> tuple[np.ndarray, int]:
        """A layer without weights: the error at its input from ``cur`` (at its output), and
        the error scale ``kq`` of a fused max-pool (unchanged elsewhere); ``front``: the
        weight layer after it whose backward made ``cur``."""
        raise NotImplementedError(f"{type(self).__name__}: no backward")


class IntWeightLayer(IntLayer):
    """A layer with integer weights ``w`` (storage grid) and their ternary copy ``t``
    (int8), both in ``weight_shape`` (the engine's layout); ``shift``: the forward's
    rounding shift ``1 + log2 alpha``; ``relu``: a ReLU right after it is fused."""

    layer: WeightLayer

    def __init__(self, layer: WeightLayer, index: int, in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...]) -> None:
        super().__init__(layer, index, in_shape, out_shape)
        self.shift = 0
        self.grad_int64 = False
        self.w = np.zeros(0, np.int8)
        self.t = np.zeros(0, np.int8)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def fan_out(self) -> int:
        """Errors summed per input cell by backward-data."""
        raise NotImplementedError

    def grad_pixels(self) -> int:
        """Products per weight and sample in the weight gradient."""
        return 1

    def relu_out(self, relu_in: bool) -> bool:
        return self.relu

    def needs_int64_grad(self, model: Numerics, batch: int) -> bool:
        """Whether a gradient sum of ``batch * grad_pixels`` products of s-bit errors and
        activations may exceed int32."""
        return model.amax * model.amax * batch * self.grad_pixels() > INT32_LIMIT

    def bind(self, model: Numerics) -> None:
        """Allocate the weights (and the copies the kernels read) for ``model``'s formats."""
        self.w = np.zeros(self.weight_shape, model.wdtype)
        self.t = np.zeros(self.weight_shape, np.int8)

    def to_internal(self, w: np.ndarray) -> np.ndarray:
        """Spec layout -> ``weight_shape`` (an exact permutation)."""
        raise NotImplementedError

    def to_spec(self, w: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def counter_layout(self) -> tuple[int, int]:
        """``(rows, cols)`` of ``kernels.sgd_update``: the order the stochastic-rounding
        counter enumerates the weights in, ``(0, 0)``: the storage order."""
        return (0, 0)

    def ternary_copies(self) -> None:
        """Refresh what the kernels read besides ``t`` after ``t`` changed."""

    def check(self, model: Numerics) -> None:
        fan_in = self.layer.fan_in
        if fan_in * model.amax > INT32_LIMIT:
            raise ConfigError(f"{self.layer.name}: fan-in {fan_in} overflows int32 at "
                              f"{model.bits} bits")
        if self.fan_out * model.amax * 4 > INT32_LIMIT:
            raise ConfigError(f"{self.layer.name}: fan-out {self.fan_out} overflows int32 at "
                              f"{model.bits} bits")

    def quantized_error(self, ws: Workspace, n: int) -> np.ndarray:
        """The quantized error at the output of the last training step, [n, *out_shape]."""
        return ws.eq[self.index][:n].copy()

    # CPU backend: the backward's tasks (step._ParamBackward runs them) -------------

    def keeps_eq(self, next_layer: IntLayer | None) -> bool:
        """Whether training keeps the quantized error at the output NHWC (``ws.eq``)."""
        return True

    def input_error_whole(self, pb: ParamPass) -> bool:
        """Whether the error at the input is one whole-batch kernel (not split over
        samples)."""
        return False

    def grad_input_tasks(self, pb: ParamPass, ws: Workspace) -> list[Task]:
        """Tasks over samples laying out what the weight gradient reads."""
        return []

    def input_error_task(self, pb: ParamPass) -> Task:
        """The error at the input (``pb.dst``)."""
        raise NotImplementedError

    def grad_task(self, pb: ParamPass, ws: Workspace, only_max: bool) -> Task:
        """The weight gradient into ``pb.g`` (``only_max``: its max |G| only, for
        :meth:`fused_update_task`); results: max |G| per part, -1 where not reported."""
        raise NotImplementedError

    def fuses_update(self, pb: ParamPass) -> bool:
        """Whether the update makes the gradient again (:meth:`fused_update_task`)."""
        return False

    def fused_update_task(self, pb: ParamPass, ws: Workspace) -> Task:
        raise NotImplementedError


class ParamPass(Protocol):
    """One weight layer's backward for batches of ``n`` samples (``step._ParamBackward``):
    the views its tasks read, and the step's values, set before they run."""

    model: Numerics
    op: IntWeightLayer
    i: int
    n: int
    p: int
    sc: list[Scratch]
    eq: np.ndarray | None     # quantized error at the output, NHWC [n, *out_shape]
    act: np.ndarray           # output activations
    a_in: np.ndarray          # input activations
    dst: np.ndarray | None    # error at the input (int32), None when not needed
    g: np.ndarray             # weight gradient (int32 / int64), weight_shape
    cur: np.ndarray           # this step's error at the output (int32)
    kq: int                   # the error scale of a fused max-pool after the layer
    sh: int                   # a fused update's shift
    key: int                  # a fused update's stochastic-rounding key

    def task(self, kernel: Callable[..., Any], args: Callable[[int, int, int], Sequence[Any]],
             total: int, align: int = 1, first: bool = False, split: bool | None = None,
             tag: int | None = None) -> Task: ...
