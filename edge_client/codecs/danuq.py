"""DANUQ (FedWSQ): the update ``delta = W - W_global`` quantized to fixed N(0, 1)
Lloyd-Max levels after standardization by the server's per-layer ``sigma_g``, bits 1..8.

Encode: ``sigma_loc = std(delta)`` (population std, float64); ``z = delta / sigma_g``
(``sigma_g`` option, default ``sigma_loc``); every element gets the level nearest to it
(computed as the nearest of the float32 codebook ``float32(levels * sigma_g)``, ties to
the lower). aux ``{"sigma_loc": float, "sigma_g": float, "zero_level": 0 | 1}``; the
levels themselves are not sent: the decoder recomputes them from ``bits`` and
``zero_level`` (:func:`edge_client.codecs.lloydmax.normal_levels`).
``zero_level`` defaults to True for bits >= 2 and False for 1 bit (the FedWSQ choice).
With ``sigma_g == 0`` (a constant-zero update with the default) everything decodes to 0.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from edge_client.codecs import kmeans1d as k1
from edge_client.codecs.base import scan_float
from edge_client.codecs.bitpack import packed_nbytes
from edge_client.codecs.lloydmax import normal_levels
from edge_client.codecs.lut import TableCodec
from edge_client.codecs.tensor import EncodedTensor
from edge_client.codecs.uplink import DeviceUpdate
from edge_client.errors import CodecError, ProtocolError


@numba.njit(cache=True)
def centred_sumsq(x, mu):
    s = 0.0
    for i in range(x.size):
        d = np.float64(x[i]) - mu
        s += d * d
    return s


def danuq_codebook(bits: int, zero_level: bool, sigma_g: float) -> np.ndarray:
    """The sorted float32 codebook ``float32(levels * sigma_g)`` both sides use (entries
    beyond float32's range become infinite; a receiver rejects such a table)."""
    with np.errstate(over="ignore"):
        return (normal_levels(bits, zero_level) * sigma_g).astype(np.float32)


class DanuqCodec(TableCodec):
    name = "danuq"
    bits_range = (1, 8)
    default_bits = 2
    lossy = True
    options = frozenset({"sigma_g", "zero_level"})
    default_content = "delta"  # FedWSQ quantizes the update, not the weights

    def update_options(self, u: DeviceUpdate, layer: int) -> dict[str, Any]:
        """An update (``delta``) is standardized by the server's σ_g when the model carried
        one per layer (FedWSQ), else by its own σ."""
        if u.delta and len(u.sigma_g) == len(u.names) and u.sigma_g[layer] > 0:
            return {"sigma_g": float(u.sigma_g[layer])}
        return {}

    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        """``x``: the float32 update. Options ``sigma_g`` (float > 0), ``zero_level`` (bool)."""
        b = self._bits(bits)
        self._options(options)
        a = self._array(x, ("float32",))
        flat = a.reshape(-1)
        lo, hi, mu, bad = scan_float(flat) if flat.size else (0.0, 0.0, 0.0, 0)
        if bad:
            raise CodecError(f"codec {self.name!r}: input has {bad} non-finite (NaN/Inf) value(s)")
        sigma_loc = float(np.sqrt(centred_sumsq(flat, mu) / flat.size)) if flat.size else 0.0
        sigma_loc = float(np.float32(sigma_loc))
        sg = options.get("sigma_g")
        if sg is None:
            sigma_g = sigma_loc
        else:
            if isinstance(sg, bool) or not isinstance(sg, (int, float, np.integer, np.floating)):
                raise CodecError(f"codec {self.name!r}: sigma_g must be a float, got {sg!r}")
            sigma_g = float(np.float32(sg))
            if not np.isfinite(sigma_g) or sigma_g <= 0:
                raise CodecError(f"codec {self.name!r}: sigma_g must be finite and > 0, got {sg!r}")
        zl = options.get("zero_level", b >= 2)
        if not isinstance(zl, (bool, np.bool_)):
            raise CodecError(f"codec {self.name!r}: zero_level must be a bool, got {zl!r}")
        cb = danuq_codebook(b, bool(zl), sigma_g)
        out = np.empty(packed_nbytes(flat.size, b), dtype=np.uint8)
        if flat.size:
            a_floor, shift, nm = k1.grid(lo, hi, mu)
            k1.assign_pack(flat, cb, mu, a_floor, shift, nm, b, out)
        aux = {"sigma_loc": sigma_loc, "sigma_g": sigma_g, "zero_level": int(bool(zl))}
        return self._tensor(a, b, out.tobytes(), aux, name)

    def _checked(self, t: EncodedTensor) -> tuple[int, np.ndarray, np.ndarray]:
        n, buf = self._check_encoded(t, ("float32",))
        self._aux_keys(t, ("sigma_loc", "sigma_g", "zero_level"))
        self._aux_float(t, "sigma_loc", nonneg=True)
        sigma_g = self._aux_float(t, "sigma_g", nonneg=True)
        zl = t.aux["zero_level"]
        if zl not in (0, 1) or not isinstance(zl, (int, bool, np.integer)):
            raise ProtocolError(f"aux.zero_level: expected 0 or 1, got {zl!r}")
        return n, buf, danuq_codebook(int(t.bits), bool(zl), sigma_g)
