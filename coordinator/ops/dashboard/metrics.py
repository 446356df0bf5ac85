"""The job's picture as Prometheus metrics (``/metrics`` of the dashboard).

A custom collector of ``prometheus_client``: the metrics are made from
:meth:`FleetMonitor.snapshot` when scraped (nothing on the round loop's path), into a
registry of the dashboard's own (no global state). Names follow Prometheus' conventions
(base units, ``_total`` for counters, ``_ratio`` for 0..1), every metric has a ``job``
label; the list: docs/operations.md#watching-a-job-the-dashboard-metrics-fedbit-status.

Counters count from the start of the run directory (a resumed run continues them) and
move at least once per round: the completed rounds' exact counts, plus the refusals the
open round has logged so far.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from coordinator.ops.dashboard.monitor import FleetMonitor

#: ``fedbit_round_duration_seconds`` buckets (s)
DURATION_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class MonitorCollector(Collector):
    """Prometheus metrics of a :class:`FleetMonitor` (see the module docstring)."""

    def __init__(self, monitor: FleetMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        snap = self.monitor.snapshot(rounds_after=0)
        job = str(snap["job"].get("job", ""))
        tot, cur, rounds = snap["totals"], snap["current"], snap["rounds"]

        def gauge(name: str, doc: str, value: float, unit: str = "") -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["job"], unit=unit)
            g.add_metric([job], value)
            return g

        def counter(name: str, doc: str, value: float, unit: str = "") -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["job"], unit=unit)
            c.add_metric([job], value)
            return c

        yield counter("fedbit_rounds_completed", "Rounds completed (aggregated and checkpointed).", len(rounds))
        yield gauge("fedbit_rounds_planned", "Rounds the job runs.", snap["rounds_planned"])
        yield gauge("fedbit_round", "The round in progress, or the last one closed.", cur.get("round", 0))
        yield gauge("fedbit_round_selected_devices", "Devices selected in the current round.",
                    cur.get("selected", 0))
        yield gauge("fedbit_round_received_updates", "Updates accepted in the current round so far.",
                    cur.get("received", 0))
        yield counter("fedbit_updates_accepted", "Updates accepted.", tot["accepted"])
        by_kind: dict[str, dict[str, int]] = {"rejected": {}, "dropped": {}}
        stragglers = 0
        for key, n in tot["refused"].items():
            kind, _, reason = key.partition("_")
            if kind in by_kind and reason:
                by_kind[kind][reason] = n
            elif key == "stragglers":
                stragglers = n
        for kind, name, doc in (("rejected", "fedbit_updates_rejected", "Messages refused, by reason."),
                                ("dropped", "fedbit_messages_dropped", "Late or repeated messages, by reason.")):
            c = CounterMetricFamily(name, doc, labels=["job", "reason"])
            for reason, n in sorted(by_kind[kind].items()):
                c.add_metric([job, reason], n)
            yield c
        yield counter("fedbit_stragglers", "Selected devices excluded at a round's deadline.", stragglers)
        c = CounterMetricFamily("fedbit_uplink", "Bytes of accepted updates, by uplink codec.",
                                labels=["job", "codec"], unit="bytes")
        for codec, n in sorted(tot["uplink_bytes"].items()):
            c.add_metric([job, codec], n)
        yield c
        last = rounds[-1] if rounds else {}
        for name, key, doc, unit in (("fedbit_accuracy", "groups", "Test accuracy of each bitwidth group's "
                                      "model after the last round.", "ratio"),
                                     ("fedbit_loss", "group_loss", "Test loss of each bitwidth group's model "
                                      "after the last round.", "")):
            g = GaugeMetricFamily(name, doc, labels=["job", "group"], unit=unit)
            for group, v in sorted((last.get(key) or {}).items()):
                if isinstance(v, int | float) and math.isfinite(v):
                    g.add_metric([job, group], v)
            yield g
        eps = next((r for r in reversed(rounds) if isinstance(r.get("epsilon"), int | float)), None)
        if eps is not None:
            g = GaugeMetricFamily("fedbit_privacy_epsilon", "Differential privacy spent so far: epsilon at the "
                                  "job's delta (dp-accounting, RDP).", labels=["job", "delta"])
            g.add_metric([job, f"{eps.get('delta', 0):g}"], float(eps["epsilon"]))
            yield g
        yield gauge("fedbit_devices_online", "Devices online (with a hello).", snap["online"])
        yield gauge("fedbit_devices_known", "Devices that said hello.", snap["registered"])
        yield gauge("fedbit_devices_quarantined", "Devices quarantined until the operator releases them.",
                    len(snap.get("quarantined", ())))
        yield counter("fedbit_alerts", "Operator alerts (rounds rolled back whole in a row).",
                      snap.get("alerts_total", 0))
        yield counter("fedbit_device_wait", "Time rounds waited for devices before selecting.",
                      tot["wait_seconds"], unit="seconds")
        yield _histogram([r.get("round_seconds") for r in rounds], job)


def _histogram(values: list[Any], job: str) -> HistogramMetricFamily:
    """``fedbit_round_duration_seconds`` over the completed rounds' times."""
    vals = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    buckets = [(f"{b:g}", sum(v <= b for v in vals)) for b in DURATION_BUCKETS]
    buckets.append(("+Inf", len(vals)))
    h = HistogramMetricFamily("fedbit_round_duration", "Round time, the wait for devices apart.",
                              labels=["job"], unit="seconds")
    h.add_metric([job], buckets, sum_value=sum(vals))
    return h


def registry_for(monitor: FleetMonitor) -> CollectorRegistry:
    """A registry of its own holding ``monitor``'s metrics."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(MonitorCollector(monitor))
    return reg
