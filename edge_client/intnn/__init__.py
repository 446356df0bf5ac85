"""Integer-only on-device training (ProWD appendix B / WAGE), Numba kernels.

Public API: the shared-domain conversions (:func:`from_shared`, :func:`to_shared`,
:func:`storage_grid_bits`, :func:`init_shared`) and :class:`IntModel`. Importing this
package never imports torch.
"""

from edge_client.intnn.model import IntModel
from edge_client.intnn.quant import (
    DEFAULT_CLIP,
    TERNARY_WEIGHT,
    act_dtype,
    act_max,
    alpha_log2,
    alpha_shifts,
    from_shared,
    grid_scale,
    init_int,
    init_shared,
    storage_grid_bits,
    ternary_threshold,
    to_shared,
    weight_dtype,
    weight_max,
)
from edge_client.intnn.workspace import Workspace

__all__ = [
    "DEFAULT_CLIP", "TERNARY_WEIGHT", "IntModel", "Workspace", "act_dtype", "act_max", "alpha_log2",
    "alpha_shifts", "from_shared", "grid_scale", "init_int", "init_shared", "storage_grid_bits",
    "ternary_threshold", "to_shared", "weight_dtype", "weight_max",
]
