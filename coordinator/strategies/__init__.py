"""Aggregation as composable streaming stages (docs/architecture.md#the-update-path):
decode -> dequantize (none | prowd) -> mask (none | prowd-swa) ->
combine (fedavg | fedshift | grouped | grouped-asym | fedpaq).

    strategy = build_strategy("prowd-swa+fedshift", tau=0.1)
    strategy.begin_round(r, global_weights)
    for update in updates: strategy.accept(update)     # streaming, O(model) memory
    # or a checked wire update (fused into the sums where its codecs allow):
    #     strategy.fold(encoded_update)
    result = strategy.finish()
"""

from coordinator.strategies.base import Strategy
from coordinator.strategies.registry import available_strategies, build_strategy, strategy_stages
from coordinator.strategies.round import RoundStrategy
from coordinator.strategies.swa import swa_mask
from coordinator.strategies.types import AggregateResult, ClientUpdate, EncodedUpdate

__all__ = ["AggregateResult", "ClientUpdate", "EncodedUpdate", "RoundStrategy", "Strategy", "available_strategies", "build_strategy",
           "strategy_stages", "swa_mask"]
