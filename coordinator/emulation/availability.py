"""When each emulated device is online: a bundled model or a trace (``[availability]``).

Times are simulated seconds from the run's start (local hour ``start_hour`` then).
``none``: always online. ``trace``: a CSV of ``device,start,end`` rows (a header allowed;
a device it does not list is always online). ``diurnal``: sessions of
``Exp(mean_session_s)``, the gap after one ending at rate ``A / ((1 - A) mean_session_s)``
per quarter hour, ``A = availability + amplitude cos(2π (hour - peak_hour) / 24)``
clipped to [0.02, 1], so a device is online about ``A`` of the time; with ``charging =
[from, to]`` (hours) only inside that window. Parameters per profile:
:data:`PROFILE_AVAILABILITY`, overridden by ``[availability.profiles.<name>]``.
``time_scale = k`` runs the model's clock k times faster than the simulated one (a day in
86,400 / k s). The draws come from the run seed and the device id.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.errors import ConfigError

MODELS = ("none", "diurnal", "trace")
DAY_S = 86_400.0
#: the diurnal model takes its target availability per slice of this many seconds
SLICE_S = 900.0


@dataclass(frozen=True)
class ProfileAvailability:
    """One profile's online behaviour (see the module docstring; hours are local time)."""

    availability: float = 1.0
    amplitude: float = 0.0
    peak_hour: float = 12.0
    mean_session_s: float = 4 * 3600.0
    charging: tuple[float, ...] = ()

    def target(self, hour: float) -> float:
        """``A``: the fraction of time online aimed at, at local ``hour`` (0 outside the
        charging window)."""
        if self.charging and not _in_window(hour, self.charging):
            return 0.0
        a = self.availability + self.amplitude * math.cos(2 * math.pi * (hour - self.peak_hour) / 24)
        return min(1.0, max(0.02, a))


#: the bundled model, by profile name (a profile not listed: always online). Assumptions,
#: not measurements: docs/experiments.md#device-availability says what each stands for.
PROFILE_AVAILABILITY: dict[str, ProfileAvailability] = {
    # a battery and solar field node: trains while charging in daylight, Wi-Fi duty-cycled
    "raspberry-pi-zero-2w": ProfileAvailability(0.6, 0.0, 12.0, 20 * 60.0, (8.0, 18.0)),
    # mains powered at home: a reboot or a Wi-Fi drop now and then
    "raspberry-pi-4": ProfileAvailability(0.95, 0.03, 20.0, 6 * 3600.0),
    # on LTE: coverage comes and goes
    "raspberry-pi-5": ProfileAvailability(0.8, 0.1, 14.0, 40 * 60.0),
    "jetson-nano": ProfileAvailability(0.95, 0.0, 12.0, 6 * 3600.0),
    # on a robot: busy (offline for training) by day, docked and charging at night
    "jetson-orin-nano": ProfileAvailability(0.6, 0.3, 2.0, 45 * 60.0),
    # an office desktop: on in working hours
    "desktop": ProfileAvailability(0.5, 0.45, 14.0, 2 * 3600.0),
}


def _device_seed(seed: int, device_id: str) -> int:
    """A stable 31-bit seed of the run seed and a device id (``emulator.derive_seed``'s
    value for ``("availability", seed, device_id)``; that module imports this one's config)."""
    h = hashlib.sha256(f"availability:{seed}:{device_id}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def _in_window(hour: float, window: tuple[float, ...]) -> bool:
    a, b = window
    h = hour % 24
    return a <= h < b if a <= b else (h >= a or h < b)


class Sessions:
    """One device's online intervals ``[start, end)``, sorted and disjoint, made as far as
    they are asked for (the diurnal model) or given (a trace, or always online)."""

    def __init__(self, intervals: list[tuple[float, float]] | None = None, *,
                 params: ProfileAvailability | None = None, seed: int = 0, start_hour: float = 0.0,
                 time_scale: float = 1.0) -> None:
        self.k = float(time_scale)  # model seconds per simulated second
        self.starts: list[float] = []
        self.ends: list[float] = []
        self._params = params
        self._hour0 = start_hour
        self._rng = np.random.default_rng(seed) if params is not None else None
        self._made = math.inf if params is None else 0.0  # sessions are known up to here
        self._on = False
        for a, b in intervals or ([(0.0, math.inf)] if params is None else []):
            self.starts.append(a)
            self.ends.append(b)
        if params is not None:
            self._on = bool(self._rng.random() < params.target(start_hour))
            if self._on:
                self.starts.append(0.0)
                self.ends.append(self._session_end(0.0))
                self._made = self.ends[-1]

    def _hour(self, t: float) -> float:
        return (self._hour0 + t * self.k / 3600.0) % 24

    def _session_end(self, t: float) -> float:
        p = self._params
        end = t + float(self._rng.exponential(p.mean_session_s / self.k))
        if p.charging:  # a session ends when the charging window closes
            close = self._next_edge(t, p.charging[1])
            end = min(end, close)
        return end

    def _next_edge(self, t: float, hour: float) -> float:
        """The first time after ``t`` when the local hour is ``hour``."""
        dt = ((hour - self._hour(t)) % 24) * 3600.0
        return t + (dt if dt > 0 else DAY_S) / self.k

    def _gap_end(self, t: float) -> float:
        """When an offline gap starting at ``t`` ends: the first event of a Poisson process
        of rate ``A / ((1 - A) mean_session_s)``, ``A`` taken per quarter hour (so a gap
        that starts at night ends soon after the morning comes)."""
        p = self._params
        while True:
            a = p.target(self._hour(t))
            if a <= 0.0:  # outside the charging window: wait for it to open
                t = self._next_edge(t, p.charging[0])
                continue
            if a >= 1.0:
                return t
            step = SLICE_S / self.k
            edge = (math.floor(t / step) + 1) * step
            w = float(self._rng.exponential(p.mean_session_s * (1 - a) / a / self.k))
            if t + w <= edge:
                return t + w
            t = edge

    def _make(self, until: float) -> None:
        while self._made <= until:
            start = self._gap_end(self._made)
            self.starts.append(start)
            self.ends.append(self._session_end(start))
            self._made = self.ends[-1]

    def online(self, t: float) -> bool:
        self._make(t)
        i = bisect.bisect_right(self.starts, t) - 1
        return i >= 0 and t < self.ends[i]

    def session_end(self, t: float) -> float:
        """When the session holding ``t`` ends (``t`` itself when offline at ``t``)."""
        self._make(t)
        i = bisect.bisect_right(self.starts, t) - 1
        return self.ends[i] if i >= 0 and t < self.ends[i] else t

    def next_change(self, t: float) -> float:
        """The first time after ``t`` the device comes online or goes offline (inf: never)."""
        self._make(t)
        i = bisect.bisect_right(self.starts, t)
        if i > 0 and t < self.ends[i - 1]:
            return self.ends[i - 1]
        while i >= len(self.starts) and self._made < math.inf:
            self._make(self._made)  # (at least one more session)
        return self.starts[i] if i < len(self.starts) else math.inf


class Availability:
    """Every device's sessions (see the module docstring); ``devices`` maps each device id
    to its profile name."""

    def __init__(self, model: str, devices: Mapping[str, str], *, seed: int = 0, start_hour: float = 0.0,
                 profiles: Mapping[str, ProfileAvailability] | None = None,
                 trace: Mapping[str, list[tuple[float, float]]] | None = None, time_scale: float = 1.0) -> None:
        self.model = model
        self.devices = dict(devices)
        self.start_hour = start_hour
        self.time_scale = time_scale
        params = dict(PROFILE_AVAILABILITY) | dict(profiles or {})
        self.sessions: dict[str, Sessions] = {}
        for d, prof in self.devices.items():
            if model == "diurnal" and prof in params:
                self.sessions[d] = Sessions(params=params[prof], seed=_device_seed(seed, d),
                                            start_hour=start_hour, time_scale=time_scale)
            elif model == "trace" and d in (trace or {}):
                self.sessions[d] = Sessions(trace[d])

    @property
    def always(self) -> bool:
        """Whether every device is always online."""
        return not self.sessions

    def online(self, device_id: str, t: float) -> bool:
        s = self.sessions.get(device_id)
        return s is None or s.online(t)

    def session_end(self, device_id: str, t: float) -> float:
        s = self.sessions.get(device_id)
        return math.inf if s is None else s.session_end(t)

    def offline_at(self, t: float) -> list[str]:
        """Devices offline at ``t``, sorted."""
        return sorted(d for d, s in self.sessions.items() if not s.online(t))

    def changes(self, t0: float, t1: float) -> list[tuple[float, str, bool]]:
        """``(time, device, online)`` of every change in ``(t0, t1]``, in time order (then
        device id)."""
        out = []
        for d, s in self.sessions.items():
            t = s.next_change(t0)
            while t <= t1:
                out.append((t, d, s.online(t)))
                t = s.next_change(t)
        return sorted(out)

    def next_change(self, t: float) -> float:
        """The first change after ``t`` of any device (inf: none)."""
        return min((s.next_change(t) for s in self.sessions.values()), default=math.inf)

    def counts(self, times: Iterable[float]) -> dict[str, list[int]]:
        """Devices online at each of ``times``, per profile."""
        times = list(times)
        out: dict[str, list[int]] = {}
        for d, prof in self.devices.items():
            row = out.setdefault(prof, [0] * len(times))
            for i, t in enumerate(times):
                row[i] += int(self.online(d, t))
        return out


def read_trace(path: str | Path, devices: Iterable[str]) -> dict[str, list[tuple[float, float]]]:
    """``{device: [(start, end)]}`` (sorted, overlaps merged) of a CSV trace; ConfigError
    naming the file and line of a bad row or a device the fleet does not have."""
    src, known = Path(path), set(devices)
    out: dict[str, list[tuple[float, float]]] = {}
    try:
        with open(src, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise ConfigError(f"availability.trace: cannot read {src} ({exc})") from None
    for n, row in enumerate(rows, 1):
        if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
            continue
        where = f"availability.trace: {src}:{n}"
        if len(row) != 3:
            raise ConfigError(f"{where}: expected device,start,end, got {row!r}")
        dev, a, b = (c.strip() for c in row)
        try:
            start, end = float(a), float(b)
        except ValueError:
            if n == 1 or not out and all(not r for r in rows[:n - 1]):
                continue  # a header row
            raise ConfigError(f"{where}: start and end must be numbers (simulated seconds), got {row!r}") from None
        if dev not in known:
            raise ConfigError(f"{where}: {dev!r} is not a device of this fleet")
        if not (math.isfinite(start) and 0 <= start < end):
            raise ConfigError(f"{where}: need 0 <= start < end, got {start}, {end}")
        out.setdefault(dev, []).append((start, end))
    for dev, iv in out.items():
        iv.sort()
        merged = [iv[0]]
        for a, b in iv[1:]:
            if a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[dev] = merged
    return out


def profile_overrides(table: Mapping[str, Any], source: str) -> dict[str, ProfileAvailability]:
    """``[availability.profiles]`` -> parameters by profile (over the bundled ones, or the
    always-online defaults); ConfigError naming the key."""
    keys = {f.name for f in fields(ProfileAvailability)}
    out = {}
    for prof, over in table.items():
        where = f"{source}: availability.profiles.{prof}"
        if not isinstance(over, dict):
            raise ConfigError(f"{where}: expected a table")
        bad = sorted(set(over) - keys)
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad} (known: {sorted(keys)})")
        p = replace(PROFILE_AVAILABILITY.get(prof, ProfileAvailability()),
                    **{k: (tuple(float(x) for x in v) if k == "charging" else float(v)) for k, v in over.items()})
        if not (0 < p.availability <= 1 and 0 <= p.amplitude <= 1 and p.mean_session_s > 0):
            raise ConfigError(f"{where}: need 0 < availability <= 1, 0 <= amplitude <= 1, mean_session_s > 0")
        if p.charging and (len(p.charging) != 2 or not all(0 <= h < 24 for h in p.charging)
                           or p.charging[0] == p.charging[1]):
            raise ConfigError(f"{where}: charging must be [from, to], two different hours in [0, 24)")
        out[prof] = p
    return out


def availability_series(av: Availability, until: float, points: int = 200) -> dict[str, Any]:
    """Devices online per profile at ``points`` times from 0 to ``until`` (simulated s), for
    the run's report: ``{"model", "start_hour", "times", "online": {profile: [n]},
    "devices": {profile: n}}``."""
    times = [until * i / max(1, points - 1) for i in range(points)] if until > 0 else [0.0]
    sizes: dict[str, int] = {}
    for prof in av.devices.values():
        sizes[prof] = sizes.get(prof, 0) + 1
    return {"model": av.model, "start_hour": av.start_hour, "time_scale": av.time_scale, "times": times,
            "online": av.counts(times), "devices": sizes}
