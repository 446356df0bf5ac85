"""Measure a device's link to its broker and pick its uplink codec from it
(``fedbit-edge measure-link``, ``fedbit-edge run --auto-codec``).

FedShift's split of a fleet into superior and inferior clients by link quality, made on
the device: the update of the round's model must upload within ``budget_s``; the most
precise codec whose upload fits is chosen, so fast links keep full precision and slow
links get the low-bit codecs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from edge_client.errors import ConfigError
from edge_client.transport.base import Transport
from hw_profiles import HardwareProfile

#: candidate uplinks, most precise first: (codec, bits); ``own`` is the profile's own
#: (float32 on a float device, its integer grid on an integer one)
LADDER: tuple[tuple[str, int], ...] = (("own", 0), ("kmeans", 8), ("kmeans", 4), ("ternary", 2))


@dataclass(frozen=True)
class LinkMeasurement:
    """``throughput_kbps`` kilobits per second of QoS 1 payload to the broker (publish
    until PUBACK); ``latency_ms`` median PUBACK round trip of a small message, ms."""

    throughput_kbps: float
    latency_ms: float
    bytes_sent: int


@dataclass(frozen=True)
class CodecChoice:
    codec: str
    bits: int
    upload_s: float  # estimated seconds to upload one update with this codec
    reason: str


def measure_link(transport: Transport, topic: str, *, probe_bytes: int = 256 * 1024, probes: int = 4,
                 pings: int = 5, timeout: float = 30.0) -> LinkMeasurement:
    """Publish ``pings`` 16-byte and ``probes`` ``probe_bytes`` messages at QoS 1 to
    ``topic`` on a connected ``transport`` (not retained) and time the acknowledgements.
    ConnectionError when an acknowledgement does not come within ``timeout`` s."""
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        if not transport.publish(topic, b"\0" * 16, qos=1, timeout=timeout):
            raise ConnectionError(f"{topic}: no acknowledgement within {timeout:.0f} s")
        rtts.append(time.perf_counter() - t0)
    latency = statistics.median(rtts)
    payload = bytes(probe_bytes)
    t0 = time.perf_counter()
    for _ in range(probes):
        if not transport.publish(topic, payload, qos=1, timeout=timeout):
            raise ConnectionError(f"{topic}: no acknowledgement within {timeout:.0f} s")
    seconds = max(time.perf_counter() - t0 - probes * latency, 1e-6)
    return LinkMeasurement(probes * probe_bytes * 8 / 1000 / seconds, latency * 1000, probes * probe_bytes + pings * 16)


def update_bytes(num_params: int, codec: str, bits: int) -> int:
    """Approximate wire bytes of one update of ``num_params`` weights: ``bits`` per weight
    plus a codebook / header allowance of 1 KiB."""
    return num_params * bits // 8 + 1024


def choose_codec(profile: HardwareProfile, num_params: int, link: LinkMeasurement, *, budget_s: float = 2.0) -> CodecChoice:
    """The most precise uplink of :data:`LADDER` whose estimated upload time (bytes /
    throughput + latency) fits ``budget_s``; the coarsest when none fits."""
    if budget_s <= 0:
        raise ConfigError(f"budget_s: must be > 0, got {budget_s}")
    own = (profile.codec, profile.codec_bits)  # a loaded profile's own uplink (int: its grid)
    candidates = [own if c == "own" else (c, b) for c, b in LADDER]
    est = []
    for codec, bits in candidates:
        s = update_bytes(num_params, codec, bits) * 8 / 1000 / max(link.throughput_kbps, 1e-9) + link.latency_ms / 1000
        est.append((codec, bits, s))
        if s <= budget_s:
            tier = "superior (full precision)" if (codec, bits) == own else "inferior (quantized uplink)"
            return CodecChoice(codec, bits, s, f"{tier}: {s:.2f} s per update <= {budget_s:g} s")
    codec, bits, s = est[-1]
    return CodecChoice(codec, bits, s, f"inferior: even {codec}-{bits} needs {s:.2f} s per update > {budget_s:g} s")
