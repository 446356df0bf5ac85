"""When an emulated run stops: at a plateau of its validation accuracy, or at ``rounds``.

A run's curve is the mean over its bitwidth groups of each round's validation accuracy
(the evaluator's per-round subsample; ``coordinator.evaluate``). At round r the run is
**still climbing** when the mean of the curve's last ``window`` rounds exceeds the mean of
the ``window`` rounds before them by more than ``min_delta`` (:func:`climbing`).

With ``[stop] plateau = true`` the first round p >= ``min_rounds`` that is not climbing is
the plateau: the run goes on for ``LAST_ROUNDS`` more rounds, the reported ones (the
only rounds that score the test split), and stops; ``rounds`` is the maximum. A run that
reaches ``rounds`` first reports its last rounds as they are, and its report says whether
it was still climbing. Only the validation split decides; without one a run cannot stop
early (a config that asks is refused) and its flag is read from the test curve, which it
describes but never acts on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from coordinator.emulation.analysis import LAST_ROUNDS
from coordinator.emulation.sections import StopSettings

if TYPE_CHECKING:  # pragma: no cover
    from coordinator.config import ServerConfig
    from coordinator.evaluate import ModelEvaluator

#: ``[stop]``'s keys and defaults (coordinator.emulation.sections.StopSettings)
STOP_DEFAULTS: dict[str, Any] = asdict(StopSettings())


def run_curve(records: Sequence[Mapping[str, Any]], key: str = "val_accuracy") -> list[float]:
    """Per round, the mean over groups of figure ``key`` (NaN where a round has none)."""
    out = []
    for r in records:
        vals = [v[key] for v in r.get("groups", {}).values() if isinstance(v.get(key), int | float)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def climbing(curve: Sequence[float], window: int, min_delta: float) -> bool | None:
    """Whether the curve's last ``window`` rounds gain more than ``min_delta`` on average
    over the ``window`` before them; None when it has fewer than ``2 window`` rounds with
    figures."""
    vals = [v for v in curve if isinstance(v, int | float) and math.isfinite(v)]
    if len(vals) < 2 * window:
        return None
    last, before = vals[-window:], vals[-2 * window:-window]
    return sum(last) / window - sum(before) / window > min_delta


def stop_summary(records: Sequence[Mapping[str, Any]], stop: Mapping[str, Any],
                 plateau_round: int | None) -> dict[str, Any]:
    """A run's stopping figures: ``rounds`` run, ``plateau_round`` (None: no plateau was
    found before the maximum), ``climbing`` at its end (None: too short to say) and the
    ``split`` the curve came from."""
    s = STOP_DEFAULTS | dict(stop)
    split, curve = "validation", run_curve(records)
    if all(math.isnan(v) for v in curve):
        split, curve = "test", run_curve(records, "accuracy")
    return {"rounds": len(records), "plateau_round": plateau_round, "split": split,
            "climbing": climbing(curve, int(s["window"]), float(s["min_delta"]))}


class Stopper:
    """The rule of a run in progress: fed each round's record (the coordinator's
    ``round_end`` event), it shortens the run at a plateau (the coordinator's
    ``cfg.rounds``) and moves the evaluator's ``report_from`` to the rounds after it."""

    def __init__(self, stop: Mapping[str, Any], server_cfg: ServerConfig, evaluator: ModelEvaluator
                 ) -> None:
        self.stop = STOP_DEFAULTS | dict(stop)
        self.server_cfg = server_cfg
        self.evaluator = evaluator
        self.records: list[Mapping[str, Any]] = []
        self.plateau_round: int | None = None

    def __call__(self, event: str, fields: Mapping[str, Any]) -> None:
        if event != "round_end":
            return
        self.records.append(fields)
        r = int(fields["round"])
        if not self.stop["plateau"] or self.plateau_round is not None or r < int(self.stop["min_rounds"]):
            return
        if climbing(run_curve(self.records), int(self.stop["window"]), float(self.stop["min_delta"])) is False:
            self.plateau_round = r
            end = min(self.server_cfg.rounds, r + LAST_ROUNDS)
            if end < self.server_cfg.rounds:  # else: the last rounds are reported anyway
                self.server_cfg.rounds = end
                self.evaluator.report_from = min(self.evaluator.report_from, r + 1)
