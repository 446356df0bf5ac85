"""The integer engine's buffers of a training or evaluation pass on the CPU backend
(:class:`Workspace`, :class:`Scratch`; ``allocation.build_workspace`` fills them, each
layer deciding its own), the planar layout's row length, and the FedProx / FedFOR terms
in integers (:class:`Regularizer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def plane_len(n: int, h: int, w: int, pad: int) -> int:
    """Row length of the padded planar layout of n samples of h x w (kernels, stride-1
    conv): ``pad*wp + pad + n*(h + pad)*wp`` with ``wp = w + pad``."""
    wp = w + pad
    return pad * wp + pad + n * (h + pad) * wp


def internal_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Spec activation shape [C, H, W] -> engine layout (H, W, C); [F] unchanged."""
    if len(shape) == 3:
        c, h, w = shape
        return (h, w, c)
    return tuple(shape)


@dataclass
class Scratch:
    """One thread's scratch buffers (lists indexed like ``IntModel.ops``, None where
    unused): ``pacc``/``pacc16``/``ptile`` pixel-block accumulators and finished outputs of
    a conv forward, ``vacc`` the int32 sums [B * Op] of the VNNI conv forward, ``offs``
    (int32 [K*K*C]) the plane-run offsets, ``pbuf`` [K*K*C] backward-data sums (int16 when
    ``O * amax`` fits, else int32), ``lacc``/``lacc16`` int32 / int16 [O] accumulators of a
    linear forward, ``lep`` its errors packed in groups of four samples for the VNNI weight
    gradient (int8 [N4 * O]); ``nz_idx``/``nz_val``: int32 lists (non-zero inputs or
    errors, a row of a max-pool's routed errors)."""

    pacc: list[np.ndarray | None]
    pacc16: list[np.ndarray | None]
    ptile: list[np.ndarray | None]
    vacc: list[np.ndarray | None]
    offs: list[np.ndarray | None]
    pbuf: list[np.ndarray | None]
    lacc: list[np.ndarray | None]
    lacc16: list[np.ndarray | None]
    lep: list[np.ndarray | None]
    nz_idx: np.ndarray
    nz_val: np.ndarray


@dataclass
class Workspace:
    """Integer buffers for batches of up to ``capacity`` samples (all views are [:n]).

    Per layer (lists indexed like ``IntModel.ops``, None where unused): ``acts`` outputs
    (s-bit), ``win`` max-pool winners (int8, :func:`kernels.maxpool_forward`), ``eq``
    quantized errors at conv/linear outputs (s-bit, NHWC / [N, O]), ``eqp`` the same at
    the positions of the stride-1 plane layout ([O, N*hs], convs whose weight gradient
    is ``"plane"``), ``err_in`` raw errors at op inputs (int32), ``patch`` int32 [O]
    accumulators of the sparse conv, ``a_t`` a linear layer's input transposed [F, N]
    (its weight gradient), ``gacc`` [O] gradient scratch (int64 path), ``col_t`` the
    transposed im2col [K*K*C, pixels] (s-bit) and ``e_t`` errors transposed [O, pixels]
    (strided convs), ``plane`` a stride-1 conv's input in the padded planar layout
    ([C, plane_len]), ``a_pad`` (the input with zero borders, NHWC) and ``gt`` ([O, K*K*C],
    gradient dtype) of the error-driven conv weight gradient (``grad_mode == "sparse"``).
    ``scratch``: per thread (:class:`Scratch`). ``grad32``/``grad64``: the weight
    gradients, one region per layer (a step's stages overlap: one layer's update runs
    with another's gradient), ``grads[param]`` its view (int32, or int64 where
    ``grad_int64``; the stored weights' shape); ``extra``: FedProx/FedFOR numerators
    (int64, ``extras[param]`` flat; only touched when those terms are on).
    """

    capacity: int
    x: np.ndarray
    acts: list[np.ndarray]
    win: list[np.ndarray | None]
    eq: list[np.ndarray | None]
    eqp: list[np.ndarray | None]
    err_in: list[np.ndarray | None]
    err_out: np.ndarray
    patch: list[np.ndarray | None]
    a_t: list[np.ndarray | None]
    gacc: list[np.ndarray | None]
    col_t: list[np.ndarray | None]
    e_t: list[np.ndarray | None]
    plane: list[np.ndarray | None]
    a_pad: list[np.ndarray | None]
    gt: list[np.ndarray | None]
    scratch: list[Scratch]
    grad32: np.ndarray
    grad64: np.ndarray
    extra: np.ndarray
    grads: list[np.ndarray] = field(default_factory=list)
    extras: list[np.ndarray] = field(default_factory=list)
    train: bool = True
    #: the training step's backward tasks per batch size (``step._backward``)
    plans: dict[int, list[Any]] = field(default_factory=dict)


@dataclass
class Regularizer:
    """FedProx / FedFOR terms in integers (built by ``IntTrainer``; the derivation is in
    docs/algorithms.md §1). Per weight and step the update gets
    ``stoch_round(((mu_q * (w - anchor)) << d_shift + alpha_q * g [g (w - anchor) > 0]) / 2^shift)``
    LSBs of the storage grid."""

    anchor: list[np.ndarray]      # received global weights, storage grid, internal layout
    step_g: list[np.ndarray]      # FedFOR's g = w_{t-1} - w_t, int32, 2^d_shift finer than the grid
    mu_q: int                     # step * mu, fixed point (frac_bits fractional bits)
    alpha_q: int                  # step * alpha, fixed point (frac_bits fractional bits)
    d_shift: int                  # log2 of the g grid's refinement: 30 - s_g
    shift: int                    # frac_bits + d_shift: the numerator's unit -> LSBs

    @property
    def active(self) -> bool:
        return self.mu_q != 0 or self.alpha_q != 0
