"""Which units of a network can still fire: live filters and units, read from the weights.

These models have no biases and their inputs are non-negative (images in [0, 1]), so a
unit whose positive taps are gone outputs <= 0 for every input; after its ReLU it is 0,
no gradient passes it (in the integer backward or the float devices' straight-through
one), and nothing brings it back (docs/training-health.md). :func:`liveness` counts such
units from the weights alone, for the forward a group runs: an s-bit integer forward
(``t = ternary(W)``, :func:`ternary_codes`; outputs ``round_shift(sum t a, 1 + log2
alpha_l)`` of activations of at most ``S(s) - 1``) or the float forward (``W / alpha_l``:
signs of ``W``, any magnitude). A unit is **live** when its output, after the ReLU that
follows it (if any), can be non-zero; it is an upper bound: a unit that is not live is
dead for certain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_client.intnn.quant import (
    act_max,
    alpha_shifts,
    grid_scale,
    ternary_threshold,
)
from firmware_models import ModelSpec

#: ``bits`` of the float forward (``W / alpha_l``, no ternarization)
FLOAT_FORWARD = 32


@dataclass
class LayerLiveness:
    """One parameter layer in one forward: ``units`` (filters or output features),
    ``live`` of them (module docstring), ``zero_frac`` the fraction of its forward weights
    that are zero (ternary codes; exact zeros for the float forward), ``nonfinite`` the
    NaN/Inf values among its weights (counted as zero in the rest)."""

    name: str
    units: int
    live: int
    zero_frac: float
    nonfinite: int


def ternary_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """int8 codes in {-1, 0, 1} of the shared-domain weights ``w`` (any shape) as an s-bit
    device ternarizes them after ``from_shared``: ``round(W S(s_g))`` (half to even)
    compared with ``S(s_g) / 4`` (the clip bound lies beyond the threshold: it changes no
    code). Non-finite values give 0."""
    q = np.rint(np.nan_to_num(np.asarray(w, dtype=np.float32), nan=0.0, posinf=0.0, neginf=0.0)
                * np.float32(grid_scale(bits)))
    thr = ternary_threshold(bits)
    return (q > thr).astype(np.int8) - (q < -thr).astype(np.int8)


def forward_codes(w: np.ndarray, bits: int) -> np.ndarray:
    """The forward's weight codes: :func:`ternary_codes` for an integer forward, the signs
    of ``w`` for the float forward (``bits == 32``)."""
    if bits >= FLOAT_FORWARD:
        return np.sign(np.nan_to_num(np.asarray(w, dtype=np.float32))).astype(np.int8)
    return ternary_codes(w, bits)


def liveness(spec: ModelSpec, weights: list[np.ndarray], bits: int,
             codes: list[np.ndarray] | None = None) -> list[LayerLiveness]:
    """Per parameter layer of ``spec`` (in order), its live units and zero codes in the
    ``bits`` forward (``32``: the float forward); ``codes``: the forward codes when the
    caller has them already (:func:`forward_codes` of each weight).

    Per activation channel two flags run from the input (``can be > 0``: all; ``can be
    < 0``: none, the inputs are non-negative): a layer output can be positive when ``P``
    taps can make it so (``t > 0`` on an input that can be positive, ``t < 0`` on one that
    can be negative) with ``round_shift(P (S(s) - 1), shift) >= 1`` (the float forward:
    ``P >= 1``), likewise negative (``live_reach``); a ReLU clears ``can be < 0``, the
    other layers carry the flags (``carry_live``; firmware_models.layers). It assumes
    every counted input at its largest value at once."""
    if codes is None:
        codes = [forward_codes(w, bits) for w in weights]
    shifts = alpha_shifts(spec)
    # the smallest count P of contributing taps that makes an output non-zero
    if bits >= FLOAT_FORWARD:
        need = [1] * len(shifts)
    else:  # round_shift(P amax, 1 + s) >= 1  <=>  P amax >= 2^s
        amax = act_max(bits)
        need = [max(1, -(-(1 << s) // amax)) for s in shifts]
    pos = np.ones(spec.input_shape[0], bool)  # per channel (or feature): can be > 0
    neg = np.zeros_like(pos)                    # can be < 0
    out: list[LayerLiveness] = []
    layers = spec.layers
    p = 0
    for i, layer in enumerate(layers):
        if not layer.has_weights:
            pos, neg = layer.carry_live(pos, neg)  # a ReLU clears "can be < 0"
            continue
        t = codes[p]
        w = np.asarray(weights[p])
        reach_pos, reach_neg = layer.live_reach(t, pos, neg)
        can_pos = reach_pos >= need[p]
        can_neg = reach_neg >= need[p]
        relu = _relu_follows(layers, i)
        live = can_pos if relu else (can_pos | can_neg)
        out.append(LayerLiveness(layer.name, int(t.shape[0]), int(live.sum()),
                                 float(np.mean(t == 0)) if t.size else 0.0,
                                 int(w.size - np.count_nonzero(np.isfinite(w)))))
        pos, neg = can_pos, can_neg
        p += 1
    return out


def _relu_follows(layers, i: int) -> bool:
    """Whether a ReLU acts on layer ``i``'s output before the next parameter layer."""
    for layer in layers[i + 1:]:
        if layer.is_relu:
            return True
        if layer.has_weights:
            return False
    return False
