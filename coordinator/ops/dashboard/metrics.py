"""The job's picture as Prometheus metrics (``/metrics`` of the dashboard).

A custom collector of ``prometheus_client``: the metrics are made from
:meth:`FleetMonitor.snapshot` when scraped (nothing on the round loop's path), into a
registry of the dashboard's own (no global state). Names follow Prometheus' conventions
``fedbit_rounds_completed_total``          counter    rounds aggregated and checkpointed
``fedbit_rounds_planned``                  gauge      rounds the job runs
``fedbit_round``                           gauge      the round in progress (or last closed)
``fedbit_round_selected_devices``          gauge      devices selected in it
``fedbit_round_received_updates``          gauge      updates accepted in it so far
``fedbit_updates_accepted_total``          counter    accepted updates
``fedbit_updates_rejected_total``          counter    refused messages, label ``reason``
``fedbit_messages_dropped_total``          counter    late or repeated messages, label ``reason``
``fedbit_stragglers_total``                counter    selected devices past a round's deadline
``fedbit_uplink_bytes_total``              counter    accepted update bytes, label ``codec``
``fedbit_accuracy_ratio``                  gauge      last round's test accuracy, label ``group``
``fedbit_loss``                            gauge      last round's test loss, label ``group``
``fedbit_privacy_epsilon``                 gauge      ε spent so far at the job's δ (DP jobs), label ``delta``
``fedbit_devices_online``                  gauge      devices online with a hello
``fedbit_devices_known``                   gauge      devices that said hello
``fedbit_device_wait_seconds_total``       counter    time rounds waited for devices
``fedbit_round_duration_seconds``          histogram  round time (the wait for devices apart)
``fedbit_model_version``                   gauge      buffered mode: the model version (applied buffers)
``fedbit_buffer_updates``                  gauge      buffered mode: updates in the open buffer
``fedbit_buffer_size``                     gauge      buffered mode: updates that fill a buffer
``fedbit_devices_training``                gauge      buffered mode: devices holding a request
``fedbit_update_staleness``                histogram  buffered mode: counted updates' staleness (versions)
``fedbit_staleness_refusals_total``        counter    buffered mode: updates refused as too stale
=========================================  =========================================
=======
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
#: ``fedbit_update_staleness`` buckets (versions)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)


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
        if cur.get("mode") == "buffered" or snap.get("staleness"):
            yield from _buffered(snap, job, gauge, counter)


def _buffered(snap: dict[str, Any], job: str, gauge: Any, counter: Any) -> Iterator[Metric]:
    """The buffered mode's metrics (see the module docstring)."""
    cur = snap["current"]
    yield gauge("fedbit_model_version", "The model version (buffers applied).", len(snap["rounds"]))
    yield gauge("fedbit_buffer_updates", "Updates in the open buffer.", cur.get("fill", 0))
    yield gauge("fedbit_buffer_size", "Updates that fill a buffer.", cur.get("size", 0))
    yield gauge("fedbit_devices_training", "Devices holding a request to train.", cur.get("in_flight", 0))
    yield counter("fedbit_staleness_refusals", "Updates refused as staler than max_staleness.",
                  snap["totals"]["refused"].get("rejected_stale", 0))
    counts = {int(k): int(v) for k, v in (snap.get("staleness") or {}).items()}
    buckets = [(f"{b}", sum(n for t, n in counts.items() if t <= b)) for b in STALENESS_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    h = HistogramMetricFamily("fedbit_update_staleness", "Staleness of counted updates, in model versions.",
                              labels=["job"])
    h.add_metric([job], buckets, sum_value=float(sum(t * n for t, n in counts.items())))
    yield h


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
