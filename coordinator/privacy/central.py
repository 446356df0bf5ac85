"""Central DP as a strategy around the job's strategy (DP-FedAvg, McMahan et al. 2018):
each update is decoded, its change ``Δ = W - W_served`` from the model that device was
served (the global model on its bitwidth's grid, ``variants.served_weights``; the global
model itself for a float device) clipped to L2 norm ``C``, the clipped updates summed
unweighted, and at the end of the round Gaussian noise of std ``z·C`` is added to the sum,
which is divided by the number of devices selected (a denominator that does not depend on
who answered) and handed to the inner strategy as one sum of changes to the global model.

With ``adaptive_clip``, ``C`` follows the ``γ`` quantile of the update norms (Andrew et
al. 2021): the count of updates within ``C`` gets noise of std σ_b = max(selected / 20, z)
and the sum's noise multiplier grows to keep the total at ``z`` (``dp.split_noise``).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from coordinator.privacy import dp
from coordinator.privacy.config import PrivacyConfig
from coordinator.strategies.base import Strategy
from coordinator.strategies.decode import decode_update
from coordinator.strategies.types import AggregateResult, EncodedUpdate
from coordinator.variants import served_weights
from edge_client.errors import ProtocolError
from edge_client.protocol import Hello, model_variant, variant_bits


def served_bits_of(update: EncodedUpdate) -> int:
    """The bitwidth of the model variant a device of the update's ``compute_bits`` is
    served when its trainer is not known (an integer trainer: ``int<s>``, else float32)."""
    return variant_bits(model_variant(update.compute_bits, "intnn"))


#: Andrew et al.'s choice: the clipped count's noise std is the expected cohort size / 20
COUNT_NOISE_FRACTION = 1 / 20


class CentralDP:
    """A :class:`~coordinator.strategies.round.RoundStrategy` that clips, sums and noises
    (see the module docstring); ``noise_multiplier`` z is set by the caller. ``served``:
    the bitwidth of the model variant the update's device was served (32: float32), from
    what the device said in its hello (default: from the update's ``compute_bits``)."""

    def __init__(self, inner: Strategy, cfg: PrivacyConfig, noise_multiplier: float,
                 selected: Callable[[], int] = lambda: 0, rng: np.random.Generator | None = None,
                 served: Callable[[EncodedUpdate], int] = served_bits_of) -> None:
        self.inner = inner
        self.name = inner.name
        self.cfg = cfg
        self.z = float(noise_multiplier)
        self.clip = float(cfg.clip)
        self.rng = rng or np.random.default_rng(secrets.randbits(128))
        self._selected = selected  # the number of devices the open round selected
        self._served = served
        self._sum: list[np.ndarray] | None = None
        self._global: list[np.ndarray] = []
        #: bits -> the round's served model as float64 [P_l] per layer (made on first use)
        self._bases: dict[int, list[np.ndarray]] = {}
        self._n = self._below = self._inferior = 0
        self.last: dict[str, float] = {}

    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        self.inner.begin_round(round_id, global_weights)
        self._global = [np.asarray(g, dtype=np.float32) for g in global_weights]
        self._bases = {}
        self._sum = [np.zeros(g.size, dtype=np.float64) for g in self._global]
        self._n = self._below = self._inferior = 0

    def fold(self, update: EncodedUpdate) -> None:
        """Decode, clip and add one update (ProtocolError, nothing added, when it is bad)."""
        if self._sum is None:
            raise ProtocolError(f"update from {update.device_id!r}: no round is open")
        cu = decode_update(update)
        if cu.kind == "weights":
            base = self._base(self._served(update))
            delta = [np.asarray(w, dtype=np.float64).reshape(-1) - g for w, g in zip(cu.weights, base, strict=True)]
        else:  # already the change from the model the device was served
            delta = [np.asarray(w, dtype=np.float64).reshape(-1) for w in cu.weights]
        norm = dp.l2_norm(delta)
        if not np.isfinite(norm):
            raise ProtocolError(f"update from {update.device_id!r}: holds NaN or Inf", reason="nonfinite")
        f = dp.clip_factor(norm, self.clip)
        for s, d in zip(self._sum, delta, strict=True):
            s += f * d
        self._n += 1
        self._below += int(norm <= self.clip)
        self._inferior += int(update.inferior)

    def _base(self, bits: int) -> list[np.ndarray]:
        """The open round's model as the ``bits`` variant was served (float64, flat layers)."""
        if bits not in self._bases:
            self._bases[bits] = [np.asarray(w, dtype=np.float64).reshape(-1)
                                 for w in served_weights(self._global, bits)]
        return self._bases[bits]

    @property
    def selected(self) -> int:
        return max(int(self._selected()), 1)

    def count_std(self) -> float:
        """σ_b: Andrew et al.'s cohort / 20, at least z (a small cohort could not afford less)."""
        return max(self.selected * COUNT_NOISE_FRACTION, self.z)

    def noise_multiplier(self) -> float:
        """The sum's noise multiplier this round (more than z with adaptive clipping, which
        spends part of the budget on the count)."""
        return dp.split_noise(self.z, self.count_std()) if self.cfg.adaptive_clip else self.z

    def finish(self) -> AggregateResult:
        if self._sum is None:
            raise ProtocolError("finish: no round is open")
        z_sum = self.noise_multiplier()
        denom = max(self.selected, self._n)
        noisy = [(s + dp.gaussian(s.shape, z_sum * self.clip, self.rng)) for s in self._sum]
        self.inner.fold_sum(32, noisy, float(denom), self._n, inferior=self._inferior, is_delta=True)
        clip = self.clip
        if self.cfg.adaptive_clip:
            below = self._below + float(self.rng.normal(0.0, self.count_std()))
            self.clip = dp.adapt_clip(self.clip, below, denom, quantile=self.cfg.clip_quantile, lr=self.cfg.clip_lr)
        self._sum = None
        result = self.inner.finish()
        self.last = {"dp_clip": clip, "dp_noise_multiplier": z_sum, "dp_noise_std": z_sum * clip / denom,
                     "dp_clipped_fraction": 1 - self._below / max(self._n, 1)}
        result.stats.update(self.last)
        return result

    def device_hparams(self, hparams: Mapping[str, Any], devices: Sequence[Hello] = ()) -> dict[str, Any]:
        return self.inner.device_hparams(hparams, devices)

    def server_state(self) -> dict[str, Any]:
        return self.inner.server_state()

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "clip": self.clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"] if "inner" in state else state)
        self.clip = float(state.get("clip", self.clip))
