"""Buffered asynchronous aggregation (``round.mode = "buffered"``, FedBuff): a versioned
global model that devices pull when asked, updates folded as they arrive, weighted by
their staleness, and the buffer applied every ``buffer_size`` updates.

- :mod:`~coordinator.buffered.settings`: the settings, staleness weights, which strategies run;
- :mod:`~coordinator.buffered.window`: the open buffer's admission rules and its fold;
- :mod:`~coordinator.buffered.loop`: :class:`BufferedCoordinator`, the loop itself.
"""

from coordinator.buffered.settings import BufferedSettings, buffered_conflict, staleness_function

__all__ = ["BufferedSettings", "buffered_conflict", "staleness_function"]
