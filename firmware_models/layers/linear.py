"""Fully connected layer, no bias; weights ``[O, F]``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from firmware_models.errors import SpecError
from firmware_models.layers.base import REQUIRED, Shape, WeightLayer

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Callable
    from types import ModuleType

    from torch import Tensor

    from firmware_models.onnx_graph import Act, Builder, IntegerGraph, QLinearGraph


@dataclass(frozen=True)
class Linear(WeightLayer):
    """Fully connected layer, no bias."""

    file_type: ClassVar[str] = "linear"
    file_aliases: ClassVar[tuple[str, ...]] = ("dense", "fc")
    name_prefix: ClassVar[str] = "fc"
    file_keys: ClassVar[Mapping[str, Any]] = {"out": REQUIRED, "in": None}

    name: str
    in_features: int
    out_features: int

    @property
    def weight_shape(self) -> Shape:
        return (self.out_features, self.in_features)

    @property
    def fan_in(self) -> int:
        return self.in_features

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 1 or shape[0] != self.in_features:
            raise SpecError(
                f"{self.name}: Linear expects [{self.in_features}], got {list(shape)}"
            )
        return (self.out_features,)

    @classmethod
    def from_file(cls, name: str, values: Mapping[str, Any], current: Shape, where: str
                  ) -> Linear:
        if len(current) != 1:
            raise SpecError(f"{where}: needs a flat input, the previous layer gives "
                            f"{list(current)} (add a flatten layer)")
        given = values["in"]
        if given is not None and given != current[0]:
            raise SpecError(f"{where}: in = {given} but the previous layer gives {current[0]} "
                            f"input features")
        return cls(name, current[0], values["out"])

    def torch_forward(self, torch: ModuleType, h: Tensor, w: Tensor | None = None) -> Tensor:
        return torch.nn.functional.linear(h, w)

    def live_reach(self, codes: np.ndarray, pos: np.ndarray, neg: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel flags of a flattened [C, H, W] expanded to its C-major features."""
        t = codes
        tp, tn = (t > 0).astype(np.int64), (t < 0).astype(np.int64)  # [O, F]
        reps = t.shape[1] // len(pos)
        if reps > 1:
            pos, neg = np.repeat(pos, reps), np.repeat(neg, reps)
        return tp @ pos + tn @ neg, tn @ pos + tp @ neg

    # ONNX ---------------------------------------------------------------------------

    def onnx_float(self, b: Builder, v: str, w: np.ndarray) -> str:
        wt = b.tensor(f"{self.name}.w", np.ascontiguousarray(w.T))
        return b.op("MatMul", [v, wt], self.name)

    def onnx_qlinear(self, g: QLinearGraph, a: Act, in_shape: Shape, t: np.ndarray,
                     shift: int, relu: bool) -> Act:
        """One ``QLinearMatMul``."""
        from firmware_models.onnx_graph import Act

        b = g.b
        zp, x_zp, y_scale, y_zp = g.requant(a, shift, relu)
        w = b.tensor(f"{self.name}.w", np.ascontiguousarray(t.T.astype(np.int8)))
        y = b.op("QLinearMatMul", [a.name, g.one, x_zp, w, g.one, g.wzp, y_scale, y_zp],
                 self.name)
        return Act(y, "u8", zp, relu)

    def onnx_integer_op(self, g: IntegerGraph, t: np.ndarray) -> Callable[[str, int], str]:
        """``MatMulInteger`` with int8 weights ``t``."""
        b = g.b
        w = b.tensor(f"{self.name}.w", np.ascontiguousarray(t.T.astype(np.int8)))

        def run(x: str, zp: int) -> str:
            return b.op("MatMulInteger", [x, w, b.const(zp, np.uint8, "x_zp")], self.name)
        return run

    def exported_weights(self, a: np.ndarray) -> np.ndarray:
        return a.T.astype(np.int16)
