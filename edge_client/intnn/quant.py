"""The shared float domain <-> a device's integers, and the paper's initialisation.

docs/algorithms.md §1-2: the shared tensor is the real weight ``W`` in ``[-clip, clip]``
(default 0.5); an s-bit device stores ``round(W * S(s_g))`` with ``S(k) = 2^(k-1)`` and
``s_g = max(s, 8)`` (the storage/gradient grid). Every layer has a power-of-two forward
scale ``alpha_l`` (paper eq. 11), kept as its base-2 exponent.
"""

from __future__ import annotations

import math

import numpy as np

from edge_client.errors import ConfigError, TrainingError
from firmware_models import ModelSpec

MIN_BITS = 2
MAX_BITS = 16
DEFAULT_CLIP = 0.5
#: The shared-domain value of a ternary forward weight ``t = +1`` (any bitwidth, any layer):
#: the integer forward divides ``sum t*a`` by ``2^(1 + log2 alpha_l)`` where the float
#: forward divides ``sum W*a`` by ``alpha_l`` (activations have the scale 1/S(s) on both
#: sides), so ``t`` computes what ``W = t / 2`` computes: WAGE's 2-bit weight levels
#: {-0.5, 0, +0.5}, which is also ``W`` rounded on the 2-bit grid (threshold |W| > 0.25).
TERNARY_WEIGHT = 0.5


def check_bits(bits: int) -> int:
    """Validate a compute bitwidth (2..16) and return it as an int."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise ConfigError(f"bits must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    if not MIN_BITS <= int(bits) <= MAX_BITS:
        raise ConfigError(f"bits must be in {MIN_BITS}..{MAX_BITS}, got {bits}")
    return int(bits)


def storage_grid_bits(bits: int) -> int:
    """``s_g = max(s, 8)``: the grid (in bits) the weights and their updates live on."""
    return max(check_bits(bits), 8)


def grid_scale(bits: int) -> int:
    """``S(s_g) = 2^(s_g - 1)``: integer weight = real weight * grid_scale."""
    return 1 << (storage_grid_bits(bits) - 1)


def act_max(bits: int) -> int:
    """Largest activation / error magnitude of an s-bit device: ``S(s) - 1``."""
    return (1 << (check_bits(bits) - 1)) - 1


def act_dtype(bits: int) -> np.dtype:
    """Storage dtype of s-bit activations and quantized errors (int8 up to 8 bits)."""
    return np.dtype(np.int8) if check_bits(bits) <= 8 else np.dtype(np.int16)


def weight_dtype(bits: int) -> np.dtype:
    """Storage dtype of the grid weights (int8 for s_g = 8, int16 above)."""
    return np.dtype(np.int8) if storage_grid_bits(bits) <= 8 else np.dtype(np.int16)


def weight_max(bits: int, clip: float = DEFAULT_CLIP) -> int:
    """Clip bound of the stored integers: ``round(clip * S(s_g))`` (64 for Int8, clip 0.5)."""
    if not 0.0 < clip < 1.0:
        raise ConfigError(f"weight clip must be in (0, 1), got {clip}")
    return min(int(round(clip * grid_scale(bits))), grid_scale(bits) - 1)


def ternary_threshold(bits: int) -> int:
    """Integer threshold of |w| > 0.25 on the storage grid: ``S(s_g) / 4``."""
    return grid_scale(bits) // 4


def alpha_log2(fan_in: int) -> int:
    """Paper eq. 11: ``log2 alpha_l = round(log2(0.75 / sqrt(3 / fan_in)))``, at least 0."""
    if fan_in < 1:
        raise ConfigError(f"fan_in must be >= 1, got {fan_in}")
    return max(0, int(round(math.log2(0.75 / math.sqrt(3.0 / fan_in)))))


def alpha_shifts(spec: ModelSpec) -> list[int]:
    """``log2 alpha_l`` per parameter layer of ``spec`` (spec.param_shapes() order)."""
    return [alpha_log2(f) for f in spec.fan_ins()]


def init_shared(spec: ModelSpec, seed: int, clip: float = DEFAULT_CLIP) -> list[np.ndarray]:
    """The initial shared weights, clipped to +-clip, by ``spec.init``: ``wage`` (paper
    eq. 10: ``W ~ U(-L, L)``, ``L = max(0.75, sqrt(3/fan_in))``) or ``he`` (Kaiming normal
    on the effective weight: ``W = alpha_l * N(0, 2 / fan_in)``, the float forward being
    ``W / alpha_l``).

    Returns float32 arrays in ``spec.param_shapes()`` order (the shared domain).
    """
    return list(_init_layers(spec, seed, clip))


def _init_layers(spec: ModelSpec, seed: int, clip: float):
    """Yield the initial weights layer by layer (float32, one layer alive at a time)."""
    rng = np.random.default_rng(seed)
    he = getattr(spec, "init", "wage") == "he"
    for shape, fan_in in zip(spec.param_shapes(), spec.fan_ins(), strict=True):
        if he:
            w = rng.standard_normal(size=shape, dtype=np.float32)
            w *= np.float32((1 << alpha_log2(fan_in)) * math.sqrt(2.0 / fan_in))
        else:
            bound = np.float32(max(0.75, math.sqrt(3.0 / fan_in)))
            w = rng.random(size=shape, dtype=np.float32)  # float32 throughout: small peak RSS
            w *= np.float32(2.0) * bound
            w -= bound
        np.clip(w, -clip, clip, out=w)
        yield w


def init_int(spec: ModelSpec, seed: int, bits: int, clip: float = DEFAULT_CLIP
             ) -> list[np.ndarray]:
    """``from_shared(init_shared(spec, seed), bits)``, computed one layer at a time."""
    return [from_shared([w], bits, clip)[0] for w in _init_layers(spec, seed, clip)]


def from_shared(weights: list[np.ndarray], bits: int,
                clip: float = DEFAULT_CLIP) -> list[np.ndarray]:
    """``clip(round(W * S(s_g)))`` per tensor, as int8 (s <= 8) or int16 (ProWD Alg. 2 l. 5).

    Rounds half to even; raises TrainingError on non-finite input.
    """
    scale = grid_scale(bits)
    wmax = weight_max(bits, clip)
    dtype = weight_dtype(bits)
    out = []
    for i, w in enumerate(weights):
        w = np.asarray(w)
        if not np.all(np.isfinite(w)):
            raise TrainingError(f"shared weight tensor {i} has NaN/Inf values")
        # float32 is exact here: a power-of-two scale, |result| <= 2^15 after the clip
        q = np.asarray(w, dtype=np.float32) * np.float32(scale)
        np.clip(q, -wmax, wmax, out=q)
        np.rint(q, out=q)
        out.append(q.astype(dtype))
    return out


def to_shared(int_weights: list[np.ndarray], bits: int) -> list[np.ndarray]:
    """``W = q / S(s_g)`` as float32; exact (a power-of-two scale of a <= 16-bit integer)."""
    scale = np.float32(grid_scale(bits))
    out = []
    for i, q in enumerate(int_weights):
        q = np.asarray(q)
        if q.dtype.kind not in "iu":
            raise TrainingError(f"integer weight tensor {i} has dtype {q.dtype}, not an integer")
        out.append(q.astype(np.float32) / scale)
    return out
