"""Local trainers of a device: IntTrainer (integer-only, intnn) and TorchTrainer (float32).

Both train the same shared parameter domain (docs/algorithms.md §2): real weights ``W`` in
``[-0.5, 0.5]``, layer outputs scaled by ``1/alpha_l``, no bias, no batch norm. Weights
enter with :meth:`load_shared` and leave with :meth:`to_shared` as ``list[np.ndarray]``
float32 in ``spec.param_shapes()`` order.

torch is imported lazily, only by :class:`TorchTrainer`: integer training never loads it.

FedProx (``prox_mu``) and FedFOR (``fedfor_alpha`` with ``last_global_step``) add
``mu (w - w_g)`` and ``alpha g [g (w - w_g) > 0]`` to each step's gradient, ``w_g`` being
the weights at the start of :meth:`train` (the received global model), with the same
strength on both kinds of device in the shared domain:

- float32 (:class:`TorchTrainer`): the terms join the data gradient after its norm is
  clipped (clipping bounds the data gradient, not the regulariser), then SGD with learning
  rate ``lr`` and momentum ``beta``. For a term that changes slowly from step to step the
  momentum buffer settles at ``term / (1 - beta)``: each step moves ``W`` by
  ``lr / (1 - beta) * (mu (W - W_g) + alpha g [.])``.
- integer (:class:`IntTrainer`, docs/algorithms.md §1-2): the device holds ``q = W S(s_g)``
  (``S(s_g) = 2^(s_g - 1)``). Its data step is WAGE's normalized one (magnitude discarded),
  so it has no float learning rate; the terms are applied beside it, with the float
  device's step ``eta_r = lr / (1 - beta)`` (the float devices' ``lr`` and ``momentum``,
  announced or default): per step, in LSBs,
  ``dq = eta_r mu (q - q_g) + eta_r alpha g S(s_g) [g (q - q_g) > 0]``,
  exactly the float device's ``dW * S(s_g)``. In integers: ``mu_q = round(eta_r mu 2^F)``,
  ``alpha_q = round(eta_r alpha 2^F)`` (F = 20 fractional bits, fewer only when the
  coefficients are so large that the int64 numerator could overflow), FedFOR's
  ``g_q = round(g 2^29)`` (int32: ``g`` keeps a resolution of 2^-29 in the shared domain,
  ``2^(30 - s_g)`` times finer than the weights, so its sign pattern survives: on Int8 a
  ``|g| = 1e-3`` is 0.128 LSB, which the grid would round to 0), and
  ``dq = stoch_round(((mu_q (q - q_g)) << (30 - s_g) + alpha_q g_q [.]) / 2^(F + 30 - s_g))``
  on its own random stream: its expectation is the float step above (up to the rounding
  of ``mu_q``/``alpha_q``, relative 2^-21 / (eta_r mu)).
"""

from __future__ import annotations

from edge_client.trainers.common import (
    DEFAULT_LR_SHIFT,
    DEFAULT_MOMENTUM,
    DEFAULT_TORCH_LR,
    Trainer,
    TrainReport,
    missing_members,
)
from edge_client.trainers.floating import TorchTrainer, forward_bits
from edge_client.trainers.integer import IntTrainer
from firmware_models import ModelSpec

__all__ = ["DEFAULT_LR_SHIFT", "DEFAULT_MOMENTUM", "DEFAULT_TORCH_LR", "IntTrainer", "TorchTrainer",
           "TrainReport", "Trainer", "forward_bits", "make_trainer", "missing_members"]


def make_trainer(spec: ModelSpec | str, bits: int, seed: int = 0, threads: int = 1,
                 **hparams) -> Trainer:
    """``bits == 32`` -> :class:`TorchTrainer`, else an s-bit :class:`IntTrainer` whose
    training steps use ``threads`` cores (torch keeps its own thread setting)."""
    if bits == 32:
        return TorchTrainer(spec, seed=seed, **hparams)
    return IntTrainer(spec, bits, seed=seed, threads=threads, **hparams)
