"""Ingest workers (``fedbit serve --ingest-workers N``): N processes take a job's updates
from an MQTT shared subscription (``$share/fedbit-<job>/fedbit/<job>/update/+``), check,
decode and fold them into partial sums, persist them to their own inbox logs and
acknowledge them; the round loop's combiner admits each update once (round, selection,
duplicate, sample bound), adds the partial sums at the round's end and recovers what a
worker that died had acknowledged. ``worker`` is a worker process, ``pool`` starts and
replaces them, ``combiner`` is the coordinator's side (docs/architecture.md#ingest-workers).
"""

from coordinator.ingest_workers.combiner import (
    IngestFleet,
    IngestWorkers,
    PartialStrategy,
    ingest_workers_for,
    refusal,
)

__all__ = ["IngestFleet", "IngestWorkers", "PartialStrategy", "ingest_workers_for", "refusal"]
