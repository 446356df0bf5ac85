"""K-means quantization (FedShift alg. 2), bits 1..8: a codebook of ``2**bits`` float32
centroids (aux ``{"codebook": [...]}``, sorted ascending) and one index per element.

``method="fast"`` (default, deterministic, ``seed`` ignored): Lloyd on a fine log-linear
histogram, started (up to 6 bits) from the exact optimal partition of a coarser set of bins
(a DP, :func:`dp_atoms`) or (7-8 bits) a Panter-Dite (cube-root density) initialisation,
then split/merge moves,
see :mod:`edge_client.codecs.kmeans1d`. ``method="authors"``: the FedShift code's
behaviour, for comparison: ``2**bits`` random elements (with replacement, ``seed``) as
initial centroids, Lloyd on every element, at most ``max_iter=300`` iterations, stop when
``(sum |shift|)**2 < tol=1e-4``, empty clusters set to 0.

Either way every element gets its *nearest* codeword (ties to the lower index), so the
error of an element is at most half the gap to the next codeword, and at most the distance
to the nearest codeword for any codebook.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_client.codecs import kmeans1d as k1
from edge_client.codecs.base import scan_float
from edge_client.codecs.bitpack import packed_nbytes
from edge_client.codecs.lut import TableCodec
from edge_client.codecs.tensor import EncodedTensor
from edge_client.codecs.uplink import DeviceUpdate
from edge_client.errors import CodecError, ProtocolError

#: Lloyd iterations per pass of the fast method (it stops at a fixed point long before).
FAST_MAX_ITER = 100_000
#: Split/merge rounds of the fast method.
FAST_MAX_ROUNDS = 64


def dp_atoms(bits: int) -> int:
    """Atoms of the exact DP start of the fast method, 0 for the Panter-Dite start.

    The DP costs O(2**bits * atoms * log atoms) whatever the tensor size (a fixed cost per
    layer that grows with the bits) and pays on heavy tails at few levels; at 7-8 bits the
    Panter-Dite start with split/merge moves is already as good, so it is kept there
    (docs/performance.md#codecs-and-the-coordinators-update-path).
    """
    if bits <= 4:
        return 2048
    return 1024 if bits <= 6 else 0


def fit_codebook(
    x: np.ndarray,
    bits: int,
    *,
    method: str = "fast",
    seed: int | None = 0,
    max_iter: int | None = None,
    tol: float = 1e-4,
    stats: tuple[float, float, float] | None = None,
) -> np.ndarray:
    """Sorted float32 codebook of ``2**bits`` centroids for the finite 1-D float32 ``x``."""
    k = 1 << bits
    if x.size == 0:
        return np.zeros(k, dtype=np.float32)
    lo, hi, mu = stats if stats is not None else scan_float(x)[:3]
    if method == "fast":
        a_floor, shift, nm = k1.grid(lo, hi, mu)
        counts, sums, sqs = k1.histogram(x, mu, a_floor, shift, nm)
        edges = k1.bin_edges(lo, hi, mu, a_floor, shift, nm)
        c, _ = k1.lloyd_histogram(
            counts, sums, sqs, edges, k, mu, a_floor, shift, nm,
            FAST_MAX_ITER if max_iter is None else max_iter, FAST_MAX_ROUNDS, dp_atoms(bits),
        )
    elif method == "authors":
        rng = np.random.default_rng(seed)
        init = x[rng.integers(0, x.size, size=k)].astype(np.float64)
        c, _ = k1.lloyd_authors(x, init, 300 if max_iter is None else max_iter, tol)
    else:
        raise CodecError(f"codec 'kmeans': method must be 'fast' or 'authors', got {method!r}")
    return np.sort(c.astype(np.float32))


class KMeansCodec(TableCodec):
    name = "kmeans"
    bits_range = (1, 8)
    default_bits = 8
    lossy = True
    finite_output = True
    options = frozenset({"method", "seed", "max_iter", "tol"})

    def update_options(self, u: DeviceUpdate, layer: int) -> dict[str, Any]:
        """The device's method; the authors' random init seeded per device and round."""
        if u.kmeans_method == "authors":
            return {"method": "authors", "seed": [int(u.seed[0]), int(u.seed[1])]}
        return {"method": u.kmeans_method}

    def encode(self, x: np.ndarray, bits: int | None = None, *, name: str = "", **options: Any) -> EncodedTensor:
        """``x``: float32 array. Options: ``method`` ("fast" | "authors"), ``seed`` (authors'
        init), ``max_iter``, ``tol`` (authors' stop). aux ``{"codebook": [2**bits floats]}``;
        an empty tensor gets a codebook of zeros."""
        b = self._bits(bits)
        self._options(options)
        a = self._array(x, ("float32",))
        flat = a.reshape(-1)
        lo, hi, mu, bad = scan_float(flat) if flat.size else (0.0, 0.0, 0.0, 0)
        if bad:
            raise CodecError(f"codec {self.name!r}: input has {bad} non-finite (NaN/Inf) value(s)")
        method = options.get("method", "fast")
        max_iter = options.get("max_iter")
        if max_iter is not None and (not isinstance(max_iter, int) or max_iter < 0):
            raise CodecError(f"codec {self.name!r}: max_iter must be an int >= 0, got {max_iter!r}")
        cb = fit_codebook(
            flat, b, method=method, seed=options.get("seed", 0), max_iter=max_iter,
            tol=float(options.get("tol", 1e-4)), stats=(lo, hi, mu),
        )
        out = np.empty(packed_nbytes(flat.size, b), dtype=np.uint8)
        if flat.size:
            a_floor, shift, nm = k1.grid(lo, hi, mu)
            k1.assign_pack(flat, cb, mu, a_floor, shift, nm, b, out)
        return self._tensor(a, b, out.tobytes(), {"codebook": [float(v) for v in cb]}, name)

    def _checked(self, t: EncodedTensor) -> tuple[int, np.ndarray, np.ndarray]:
        n, buf = self._check_encoded(t, ("float32",))
        self._aux_keys(t, ("codebook",))
        return n, buf, codebook_from_aux(t.aux["codebook"], 1 << int(t.bits))



_F32_MAX = float(np.finfo(np.float32).max)


def codebook_from_aux(value: object, k: int, field: str = "aux.codebook") -> np.ndarray:
    """A received codebook as float32 (ProtocolError: not a list of ``k`` finite float32s)."""
    if not isinstance(value, (list, tuple)):
        raise ProtocolError(f"{field}: expected a list of {k} floats, got {type(value).__name__}")
    if len(value) != k:
        raise ProtocolError(f"{field}: {len(value)} entries, expected 2**bits = {k}")
    # checked per distinct type (a received list holds one or two), not per entry
    if not all(issubclass(tp, (int, float)) and not issubclass(tp, bool) for tp in set(map(type, value))):
        raise ProtocolError(f"{field}: entries must be numbers")
    arr = np.array(value, dtype=np.float64)
    if arr.size and not float(np.max(np.abs(arr))) <= _F32_MAX:  # NaN fails the comparison too
        raise ProtocolError(f"{field}: entries must be finite float32 values", reason="nonfinite")
    return arr.astype(np.float32)
