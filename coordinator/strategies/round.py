"""The seam between the round loop and aggregation: :class:`RoundStrategy`, what
:class:`~coordinator.server.Coordinator` and :class:`~coordinator.collect.Collector` call on
a strategy. :class:`~coordinator.strategies.base.Strategy` (``build_strategy``) is the
implementation; a research strategy of one's own only needs these methods.

Per round: ``begin_round`` (the model every device received), ``fold`` for each checked
update (streamed into running sums), ``finish`` (the new global model). Around it:
``device_hparams`` (what the announcement carries: the configured hyper-parameters plus
what the strategy's method needs), ``server_state`` (what devices receive with the model,
e.g. FedWSQ's sigma_g), ``state_dict`` / ``load_state_dict`` (checkpoints).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from coordinator.strategies.types import AggregateResult, EncodedUpdate
from edge_client.protocol import Hello


@runtime_checkable
class RoundStrategy(Protocol):
    """What the round loop calls (see the module docstring)."""

    name: str

    def begin_round(self, round_id: int, global_weights: list[np.ndarray]) -> None:
        """Open round ``round_id`` from the float32 global model (one array per layer)."""

    def fold(self, update: EncodedUpdate) -> None:
        """Fold one checked wire update into the round; ProtocolError (nothing added) when
        a tensor is bad."""

    def finish(self) -> AggregateResult:
        """Close the round: the new global model (and per-group models), with stats."""

    def device_hparams(self, hparams: Mapping[str, Any], devices: Sequence[Hello] = ()) -> dict[str, Any]:
        """The hyper-parameters to announce; ConfigError when a configured one contradicts
        the strategy."""

    def server_state(self) -> dict[str, Any]:
        """What devices receive with the model (may be empty)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume after a crash (msgpack-able)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
