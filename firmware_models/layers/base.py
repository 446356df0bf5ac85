"""What every layer kind of a :class:`~firmware_models.spec.ModelSpec` knows about itself,
on no engine: its shapes, how a model file writes it, its float reference (torch, passed
in, never imported), its liveness flags and its ONNX nodes (the graph builders of
:mod:`firmware_models.onnx_graph`, passed in). The integer engine's side of a kind is in
``edge_client.intnn.layers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from types import ModuleType

    from torch import Tensor

    from firmware_models.onnx_graph import Act, Builder, IntegerGraph, QLinearGraph

Shape = tuple[int, ...]
#: no cells added around an image input (top, left, bottom, right)
NO_PADS = (0, 0, 0, 0)
#: a model file's key without a default (``SpecLayer.file_keys``)
REQUIRED = object()


class SpecLayer:
    """A layer kind: a frozen dataclass whose first field is ``name``.

    Class attributes: ``file_type`` (a model file's ``type``; ``file_aliases`` also
    accepted), ``name_prefix`` (default names ``<prefix><n>``), ``file_keys`` (a model
    file's keys with their defaults; ``REQUIRED`` marks a key without one),
    ``has_weights``, ``is_relu`` (an elementwise ``max(0, x)``, which a weight layer right
    before it computes with its own output), ``commutes_with_clip`` (the integer graph may
    clip its output instead of its input: a max).
    """

    file_type: ClassVar[str] = ""
    file_aliases: ClassVar[tuple[str, ...]] = ()
    name_prefix: ClassVar[str] = ""
    file_keys: ClassVar[Mapping[str, Any]] = {}
    has_weights: ClassVar[bool] = False
    is_relu: ClassVar[bool] = False
    commutes_with_clip: ClassVar[bool] = False
    name: str

    def output_shape(self, shape: Shape) -> Shape:
        """The output shape of an input ``shape`` (no batch); SpecError when it does not fit."""
        raise NotImplementedError

    @classmethod
    def default_name(cls, n: int) -> str:
        """The name of the n-th layer of this kind in a model file that names none."""
        return f"{cls.name_prefix}{n}"

    @classmethod
    def from_file(cls, name: str, values: Mapping[str, Any], current: Shape, where: str
                  ) -> SpecLayer:
        """The layer a model file's table describes (``values``: its keys, defaults filled
        in, integers checked); ``current``: the shape it reads; ``where`` prefixes errors."""
        return cls(name)  # type: ignore[call-arg]

    # float reference ----------------------------------------------------------------

    def torch_forward(self, torch: ModuleType, h: Tensor) -> Tensor:
        """The float forward of a batch ``h`` [N, ...] (``torch``: the torch module)."""
        raise NotImplementedError

    def torch_int_forward(self, torch: ModuleType, h: Tensor, one: float) -> Tensor:
        """The s-bit integer engine's forward in float32, activations on the ``1 / one``
        grid (``one = 2^(s-1)``): the float forward unless rounding differs."""
        return self.torch_forward(torch, h)

    # liveness -----------------------------------------------------------------------

    def carry_live(self, pos: np.ndarray, neg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel flags "can be > 0" / "can be < 0" of the output, from the input's
        (edge_client.intnn.liveness): carried unchanged unless the layer says otherwise."""
        return pos, neg

    # ONNX ---------------------------------------------------------------------------

    def qlinear_input(self, in_shape: Shape) -> tuple[int, tuple[int, int, int, int]]:
        """(zero channels, cells (top, left, bottom, right)) the byte graph adds to an image
        input read by this layer first."""
        return 0, NO_PADS

    def onnx_float(self, b: Builder, v: str) -> str:
        """The float graph's node(s) on tensor ``v``; returns the output's name."""
        raise NotImplementedError

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape) -> Act:
        """The byte graph's node(s) (s <= 8; ``in_shape``: C, H, W or F)."""
        raise NotImplementedError

    def onnx_widened(self, g: IntegerGraph, a: Act, in_shape: Shape) -> Act:
        """The int32 graph's node(s)."""
        raise NotImplementedError


class WeightLayer(SpecLayer):
    """A layer with a weight tensor (no bias): ``weight_shape`` (spec layout), ``fan_in``
    (inputs summed per output)."""

    has_weights: ClassVar[bool] = True

    @property
    def weight_shape(self) -> Shape:
        raise NotImplementedError

    @property
    def fan_in(self) -> int:
        raise NotImplementedError

    def torch_forward(self, torch: ModuleType, h: Tensor,  # type: ignore[override]
                      w: Tensor | None = None) -> Tensor:
        """``sum w * h`` of a batch ``h`` with weights ``w`` (spec layout; the caller scales)."""
        raise NotImplementedError

    def live_reach(self, codes: np.ndarray, pos: np.ndarray, neg: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Per output unit, the taps that can make it positive and negative: codes in
        {-1, 0, 1} (spec layout) against the input's per-channel flags."""
        raise NotImplementedError

    def onnx_float(self, b: Builder, v: str, w: np.ndarray) -> str:  # type: ignore[override]
        """``sum w * v`` with float32 weights ``w`` (spec layout) in the float graph."""
        raise NotImplementedError

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape,  # type: ignore[override]
                     t: np.ndarray, shift: int, relu: bool) -> Act:
        """``round_shift(relu?(sum t * a), shift)`` on bytes, but the upper clip (the
        graph's ``clip``); ``t``: int8 ternary weights, spec layout."""
        raise NotImplementedError

    def onnx_integer_op(self, g: IntegerGraph, t: np.ndarray) -> Callable[[str, int], str]:
        """The int32 graph's ``sum t * (x - zp)`` on one uint8 tensor ``x``: its weights
        added to the graph once, then a node per call."""
        raise NotImplementedError

    def onnx_widened(self, g: IntegerGraph, a: Act, in_shape: Shape,  # type: ignore[override]
                     t: np.ndarray, shift: int, relu: bool) -> Act:
        """``clip(round_shift(relu?(sum t * a), shift), +-amax)`` in int32."""
        acc = g.integer_sum(a, self.onnx_integer_op(g, t), self.name)
        return g.finish(acc, shift, relu, self.name)

    def exported_weights(self, a: np.ndarray) -> np.ndarray:
        """The ternary weights (int16, spec layout when the export is one of fedbit's) of
        the initializer ``a`` the integer graph stored for this layer."""
        raise NotImplementedError

