"""ProWD's progressive weight dequantizer (paper §4.2, appendix C; docs/algorithms.md §4).

``dequantize="prowd"`` in ``coordinator.strategies`` builds :class:`ProwdDequantizer`
(``stage``): trained in a background thread between rounds on float32 devices' weights and
the global model (``train``), judged per layer on held-out weights (``version``), applied
to low-bit updates before masking and combining. ``config`` holds the settings,
``ladder`` the quantizers and the grid detection, ``blocks`` the weight blocks,
``network`` the torch blocks φ(w) = w + τ·(ρ'(ρ(w)) - w). Importing this package imports
torch (the coordinator's ``dequantize="prowd"`` imports it when the stage is built).
"""

from coordinator.strategies.prowd_dequantizer.config import LADDERS, DequantizerConfig
from coordinator.strategies.prowd_dequantizer.stage import ProwdDequantizer, load_buffer

__all__ = ["LADDERS", "DequantizerConfig", "ProwdDequantizer", "load_buffer"]
