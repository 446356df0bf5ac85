"""What the round loop asks of the defense (:class:`RoundDefense`): the guarded strategy,
who may not be selected, and after each round the strikes, the quarantines and the
record's ``defense`` entry."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from coordinator.defense.config import DefenseConfig
from coordinator.defense.guard import GuardedStrategy
from coordinator.defense.reputation import Reputation
from coordinator.strategies.round import RoundStrategy

#: quarantined devices a round's record names (the count covers all)
LISTED = 100


class RoundDefense:
    """The defense of one job (see the module docstring).

    Args:
        cfg: the ``[defense]`` settings.
        run_dir: where the reputation is kept (None: in memory only).
        on_event: the round loop's progress callback (``quarantine`` events: ``device``,
            ``change`` = ``quarantined`` | ``released``, ``round``, ``reasons``).
        logger: where quarantines and releases are logged.
    """

    def __init__(self, cfg: DefenseConfig, run_dir: str | Path | None = None, *,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.cfg = cfg
        self.reputation = Reputation(cfg.strikes, cfg.window, run_dir, logger=logger)
        self.guard: GuardedStrategy | None = None
        self.on_event = on_event or (lambda _e, _f: None)
        self.log = logger or logging.getLogger("fedbit.defense")
        self._collapsed: frozenset[str] = frozenset()  # this round's updates that collapsed the model
        self._rollbacks: list[int] = []  # the current run of consecutive rounds rolled back whole

    def wrap(self, strategy: RoundStrategy) -> RoundStrategy:
        """``strategy`` with the guard around it."""
        self.guard = GuardedStrategy(strategy, self.cfg)
        return self.guard

    def restore(self) -> None:
        """A resumed run: its strikes and quarantines."""
        self.reputation.load()

    def quarantined(self, round_id: int) -> frozenset[str]:
        """Before round ``round_id``'s selection: the operator's releases taken, the devices
        that may not be selected."""
        for dev in self.reputation.take_releases():
            self.on_event("quarantine", {"device": dev, "change": "released", "round": round_id, "reasons": []})
        self.reputation.save()
        return frozenset(self.reputation.quarantined)

    def after_round(self, round_id: int, accepted: Iterable[str], refused: Mapping[str, str],
                    over_claimed: Iterable[str]) -> dict[str, Any]:
        """Round ``round_id`` is aggregated: ``accepted`` devices, ``refused`` ones (device ->
        the reason its update was refused for its content), ``over_claimed`` (devices whose
        sample claim was cut to their bound). Records the strikes, quarantines who has too
        many; returns the record's ``defense`` entry."""
        struck: dict[str, str] = {dev: "its update collapsed the model" for dev in sorted(self._collapsed)}
        self._collapsed = frozenset()
        if self._rollbacks and self._rollbacks[-1] != round_id:
            self._rollbacks = []
        for dev, ratio in sorted((self.guard.bounded if self.guard else {}).items()):
            struck.setdefault(dev, f"update norm {ratio:.3g}x the round's median")
        for dev, why in refused.items():
            struck[dev] = f"update refused ({why})"
        for dev in over_claimed:
            struck.setdefault(dev, "claimed more samples than its bound")
        new = self.reputation.record(round_id, set(accepted) | set(refused), struck)
        q = self.reputation.quarantined
        for dev in new:
            self.on_event("quarantine", {"device": dev, "change": "quarantined", "round": round_id,
                                         "reasons": q[dev]["reasons"]})
        self.reputation.save()
        return {"struck": dict(list(struck.items())[:LISTED]), "quarantined": len(q),
                "quarantined_ids": sorted(q)[:LISTED], "newly_quarantined": new,
                "rolled_back_in_a_row": len(self._rollbacks)}

    def collapsed_by(self, devices: frozenset[str]) -> None:
        """The round's aggregate without ``devices``' updates was healthy, with them it
        collapsed (:mod:`coordinator.defense.recover`): a strike each."""
        self._collapsed = devices

    def rolled_back(self, round_id: int) -> None:
        """Round ``round_id`` was rolled back whole (no update could be blamed). Rollbacks in
        ``ALERT_AFTER`` consecutive rounds or more raise an operator alert (the log at
        ERROR, an ``alert`` event: the terminal, the dashboard), each round it lasts: the
        model is not moving."""
        from coordinator.defense.recover import ALERT_AFTER

        if self._rollbacks and self._rollbacks[-1] != round_id - 1:
            self._rollbacks = []
        self._rollbacks.append(round_id)
        if len(self._rollbacks) >= ALERT_AFTER:
            text = (f"rounds {self._rollbacks[0]}-{round_id} all collapsed and were rolled back whole: the model "
                    f"has not moved since round {self._rollbacks[0] - 1}; look at the devices' updates (the "
                    f"round records' health and defense entries), quarantine or revoke, or stop the job")
            self.log.error("ALERT: %s", text, extra={"event": "alert", "round": round_id})
            self.on_event("alert", {"round": round_id, "text": text})
