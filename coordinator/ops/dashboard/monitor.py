"""The live picture of one job, built from the round loop's events.

:class:`FleetMonitor` is an ``on_event`` callback of the
:class:`~coordinator.server.Coordinator` (``round_start``, ``update``, ``reject``,
``device``, ``round_end``, ``buffer``, ...). It keeps ``devices`` (every device with an
accepted hello: profile, variant, codec, online, last seen, last update, refusals, why it
is quarantined), ``alerts``, ``current`` (the round in progress, or buffered mode's open
buffer: version, fill, devices training), ``staleness`` (buffered mode's counted updates
per staleness), ``rounds`` (one compact record each) and ``totals`` (accepted updates,
refusals, uplink bytes by codec, seconds waited: the completed rounds' exact figures plus
what the open round logged so far). Times are Unix seconds.

Per event the round loop pays a few dict updates under a lock and one call per listener
(which must not block); copies and JSON are made by the readers (:meth:`snapshot`, in
their own threads). :class:`LiveFile` writes the picture without the rounds to
``RUN_DIR/live.json`` at most once a second from its own thread, for ``fedbit status``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.state import private_opener
from edge_client.protocol import model_variant

#: the file :class:`LiveFile` keeps in a run directory
LIVE_FILE = "live.json"
#: refusals kept for the page's "recent refusals" list
RECENT = 20
#: devices a snapshot lists (by id; the counts cover all): a page or live.json of a fleet
#: of 100,000 would be megabytes several times a second
DEVICE_ROWS = 500
#: outstanding devices of the open round a snapshot names (the count covers all)
OUTSTANDING_ROWS = 50
#: devices refused before any hello of theirs was accepted (a wrong MAC key, not enrolled)
#: that get a row, so the operator sees who; more are only counted
STRANGERS = 100


@dataclass
class DeviceView:
    """One device as the operator sees it (times are Unix seconds)."""

    device_id: str
    profile: str = ""
    variant: str = ""  # the model it runs: int8, float32, ...
    codec: str = ""  # declared uplink codec, "<codec>-<bits>"
    samples: int = 0  # declared local samples
    online: bool = False
    last_seen: float = 0.0
    updates: int = 0  # accepted updates
    last_round: int | None = None
    last_bytes: int = 0
    last_codec: str = ""
    refusals: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    registered: bool = True  # False: only refused so far (no accepted hello)
    quarantined: list[str] = field(default_factory=list)  # why, while it is quarantined (coordinator.defense)

    def as_dict(self) -> dict[str, Any]:
        """A plain copy (``dataclasses.asdict`` without its recursive deep copy, which these fields do not need)."""
        return {**vars(self), "refusals": dict(self.refusals), "notes": dict(self.notes),
                "quarantined": list(self.quarantined)}


def round_summary(rec: dict[str, Any]) -> dict[str, Any]:
    """The compact record of a completed round (from the coordinator's metrics record)."""
    groups = rec.get("groups") or {}
    return _finite({
        "round": rec.get("round"), "time": rec.get("time"), "accuracy": rec.get("accuracy"),
        "loss": rec.get("loss"), "groups": {g: v.get("accuracy") for g, v in groups.items()},
        "group_loss": {g: v.get("loss") for g, v in groups.items()},
        "selected": rec.get("selected", 0), "accepted": rec.get("accepted", 0),
        "stragglers": rec.get("stragglers", 0), "aggregated": rec.get("aggregated", True),
        "round_seconds": rec.get("round_seconds"), "wait_seconds": rec.get("wait_seconds", 0.0),
        "sim_time": rec.get("sim_time"), "uplink_bytes": dict(rec.get("uplink_bytes") or {}),
        "counts": dict(rec.get("counts") or {}),
        "epsilon": rec.get("epsilon"), "delta": rec.get("delta"), "mode": rec.get("mode", "sync"),
        "staleness_mean": rec.get("staleness_mean"), "staleness_max": rec.get("staleness_max"),
    })


def outstanding_fields(current: dict[str, Any], most: int = OUTSTANDING_ROWS) -> dict[str, Any]:
    """``outstanding`` (how many selected devices of the open round neither answered nor
    are gone) and ``outstanding_ids`` (the first ``most`` of them, by id)."""
    left = set(current.get("selected_ids") or ()) - set(current.get("received_ids") or ()) \
        - set(current.get("gone") or ())
    return {"outstanding": len(left), "outstanding_ids": sorted(left)[:most]}


class FleetMonitor:
    """See the module docstring.

    Args:
        job: the job's configuration, shown as it is (no secrets in it).
        rounds: rounds the job runs.
        title: a one-line name of the job (page title).
        clock: Unix time source (s).
    """

    def __init__(self, job: dict[str, Any] | None = None, rounds: int = 0, title: str = "fedbit",
                 clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self.clock = clock
        self.run = 0
        self.version = 0
        self.dashboard_url = ""
        self.new_run(job or {}, rounds, title)

    # ------------------------------------------------------------------ set-up

    def new_run(self, job: dict[str, Any], rounds: int, title: str) -> None:
        """Start a fresh picture (``fedbit emulate`` runs several jobs one after the other)."""
        with self._lock:
            self.run += 1
            self.job = _finite(copy.deepcopy(job))
            self.rounds_planned = int(rounds)
            self.title = title
            self.state = "starting"
            self.devices: dict[str, DeviceView] = {}
            self._order: list[str] | None = None  # device ids sorted, cached
            self.n_online = 0
            self.n_strangers = 0
            self.current: dict[str, Any] = {"round": 0, "phase": "waiting", "selected": 0, "received": 0}
            self.rounds: list[dict[str, Any]] = []
            self.done: Counter[str] = Counter()  # completed rounds' totals
            self.live: Counter[str] = Counter()  # the open round's, as logged so far
            self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
            self.staleness_done: Counter[int] = Counter()  # completed buffers' updates by staleness
            self.staleness_live: Counter[int] = Counter()  # the open buffer's
            self.quarantined: set[str] = set()  # devices in quarantine (named on the page)
            self.alerts: deque[dict[str, Any]] = deque(maxlen=RECENT)  # operator alerts (coordinator.defense)
            self.n_alerts = 0
            self.version += 1
        self._notify()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` after every change, on the thread that made it; it must not block."""
        self._listeners.append(fn)

    def load_history(self, records: list[dict[str, Any]]) -> None:
        """The completed rounds of a resumed run (``metrics.jsonl``)."""
        for rec in records:
            with self._lock:
                self._round_end(rec)
        self._notify()

    def close(self, state: str) -> None:
        """The job ended: ``done``, ``stopped`` or ``error``."""
        with self._lock:
            self.state = state
            self.version += 1
        self._notify()

    # ------------------------------------------------------------------ events

    def __call__(self, event: str, f: dict[str, Any]) -> None:
        handler = self._handlers.get(event)
        if handler is None:
            return
        with self._lock:
            handler(self, f)
            self.version += 1
        self._notify()

    def _notify(self) -> None:
        for fn in self._listeners:
            fn()

    def _device(self, device_id: str) -> DeviceView | None:
        d = self.devices.get(device_id)
        if d is not None:
            d.last_seen = self.clock()
        return d

    def _on_device(self, f: dict[str, Any]) -> None:
        d = self.devices.get(f["device"])
        if d is None:
            d = self.devices[f["device"]] = DeviceView(f["device"])
            self._order = None
        elif not d.registered:
            d.registered = True
            self.n_strangers -= 1
        d.last_seen = self.clock()
        online = f["change"] == "joined"
        self.n_online += int(online) - int(d.online)
        d.online = online
        if self.current.get("phase") == "waiting":
            self.current["present"] = f.get("online")
        if d.online:
            d.profile, d.codec, d.samples = str(f.get("profile", "")), str(f.get("codec", "")), \
                int(f.get("num_samples", 0))
            d.variant = model_variant(int(f.get("compute_bits", 32)), str(f.get("trainer", "float")))

    def _on_waiting(self, f: dict[str, Any]) -> None:
        self.state = "running"
        self.current.update(phase="waiting", present=f.get("present"), need=f.get("need"))

    def _on_round_start(self, f: dict[str, Any]) -> None:
        now = self.clock()
        self.state = "running"
        self.current = {"round": f["round"], "phase": "collecting", "selected": len(f["selected"]),
                        "selected_ids": list(f["selected"]), "received": 0, "received_ids": [],
                        "started": now, "deadline": now + float(f.get("deadline_s") or 0.0),
                        "wait_seconds": f.get("wait_seconds", 0.0), "resumed": f.get("resumed", False)}

    def _on_gone(self, f: dict[str, Any]) -> None:
        if f.get("round") == self.current.get("round"):
            self.current.setdefault("gone", {})[str(f["device"])] = str(f.get("why", "left"))

    def _on_update(self, f: dict[str, Any]) -> None:
        if self.current.get("mode") != "buffered":  # (buffered: the buffer event's fill)
            self.current["received"] = f.get("accepted", self.current.get("received", 0))
            self.current.setdefault("received_ids", []).append(f["device"])
        n = int(f.get("bytes", 0))
        self.live["accepted"] += 1
        self.live[f"bytes:{f.get('codec', '?')}"] += n
        d = self._device(f["device"])
        if d is not None:
            d.updates += 1
            d.last_round, d.last_bytes, d.last_codec = f.get("round"), n, str(f.get("codec", ""))
            for note in f.get("notes", ()):
                d.notes[note] = d.notes.get(note, 0) + 1

    def _on_reject(self, f: dict[str, Any]) -> None:
        metric = f"{'dropped' if f.get('dropped') else 'rejected'}_{f.get('reason', '?')}"
        self.live[metric] += 1
        dev = str(f.get("device", ""))
        d = self._device(dev)
        if d is None and dev and self.n_strangers < STRANGERS:
            d = self.devices[dev] = DeviceView(dev, registered=False, last_seen=self.clock())
            self.n_strangers += 1
            self._order = None
        if d is not None:
            d.refusals[f.get("reason", "?")] = d.refusals.get(f.get("reason", "?"), 0) + 1
        self.recent.append({"time": self.clock(), "device": f.get("device", ""), "kind": f.get("kind", ""),
                            "reason": f.get("reason", ""), "dropped": bool(f.get("dropped")),
                            "detail": str(f.get("detail", ""))[:200]})

    def _on_buffer(self, f: dict[str, Any]) -> None:
        self.state = "running"
        self.current = {"round": f["version"], "phase": "buffering", "mode": "buffered", "version": f["version"],
                        "fill": f["fill"], "size": f["size"], "in_flight": f["in_flight"],
                        "received": f["fill"], "selected": f["size"]}
        if f.get("staleness") is not None:
            self.staleness_live[int(f["staleness"])] += 1

    def _on_quarantine(self, f: dict[str, Any]) -> None:
        dev = str(f.get("device", ""))
        d = self.devices.get(dev) or self.devices.setdefault(dev, DeviceView(dev))
        d.quarantined = [str(r) for r in f.get("reasons") or ["quarantined"]] if f.get("change") == "quarantined" \
            else []
        if d.quarantined:
            self.quarantined.add(dev)
        else:
            self.quarantined.discard(dev)
        self._order = None

    def _on_alert(self, f: dict[str, Any]) -> None:
        self.alerts.append({"time": self.clock(), "round": f.get("round"), "text": str(f.get("text", ""))})
        self.n_alerts += 1

    def _on_round_end(self, f: dict[str, Any]) -> None:
        self._round_end(f)
        now = self.clock()
        self.rounds[-1]["closed_at"] = now
        self.current.update(phase="closed", closed=now, stragglers=f.get("stragglers", 0))
        if self.rounds_planned and f.get("round", 0) >= self.rounds_planned:
            self.state = "done"

    def _round_end(self, rec: dict[str, Any]) -> None:
        s = round_summary(rec)
        self.rounds.append(s)
        self.live = Counter()
        self.done["rounds"] += 1
        self.done["accepted"] += int(s["accepted"])
        for k, v in s["counts"].items():
            self.done[k] += int(v)
        for codec, n in s["uplink_bytes"].items():
            self.done[f"bytes:{codec}"] += int(n)
        self.done["wait_milliseconds"] += int(1000 * (s["wait_seconds"] or 0.0))
        self.staleness_live = Counter()
        for u in rec.get("updates") or ():
            self.staleness_done[int(u.get("staleness", 0))] += 1

    _handlers: dict[str, Callable[[FleetMonitor, dict[str, Any]], None]] = {
        "device": _on_device, "waiting": _on_waiting, "round_start": _on_round_start, "update": _on_update,
        "reject": _on_reject, "round_end": _on_round_end, "gone": _on_gone, "quarantine": _on_quarantine,
        "alert": _on_alert, "buffer": _on_buffer}

    # ------------------------------------------------------------------ readers

    @property
    def completed(self) -> int:
        """Rounds completed in this run."""
        return len(self.rounds)

    def totals(self) -> dict[str, Any]:
        """Completed rounds plus the open round so far: ``rounds``, ``accepted``,
        ``refused`` ({counter: n}), ``uplink_bytes`` ({codec: bytes}), ``wait_seconds``."""
        with self._lock:
            return self._totals()

    def _sorted(self) -> list[str]:
        if self._order is None:
            self._order = sorted(self.devices)
        return self._order

    def _totals(self) -> dict[str, Any]:
        both = self.done + self.live
        return {"rounds": both["rounds"], "accepted": both["accepted"],
                "refused": {k: v for k, v in sorted(both.items())
                            if k not in ("rounds", "accepted", "wait_milliseconds") and not k.startswith("bytes:")},
                "uplink_bytes": {k[6:]: v for k, v in sorted(both.items()) if k.startswith("bytes:")},
                "wait_seconds": both["wait_milliseconds"] / 1000}

    def snapshot(self, rounds_after: int | None = 0) -> dict[str, Any]:
        """A JSON-ready copy: everything, with the completed rounds after the first
        ``rounds_after`` (None: no rounds). The job table and the round records are never
        changed once stored, so they are shared, not copied (a reader must not modify them)."""
        with self._lock:
            cur = dict(self.current)
            for key in ("selected_ids", "received_ids"):
                if key in cur:
                    cur[key] = list(cur[key])
            if cur.get("phase") == "collecting":
                cur |= outstanding_fields(cur)
            if "gone" in cur:
                cur["gone"] = dict(cur["gone"])
            out = {
                "run": self.run, "version": self.version, "now": self.clock(), "title": self.title,
                "state": self.state, "rounds_planned": self.rounds_planned, "job": self.job,
                "dashboard": self.dashboard_url, "current": cur,
                "devices": [self.devices[i].as_dict() for i in self._sorted()[:DEVICE_ROWS]],
                "devices_total": len(self.devices), "registered": len(self.devices) - self.n_strangers,
                "online": self.n_online, "quarantined": sorted(self.quarantined)[:DEVICE_ROWS],
                "alerts": list(self.alerts), "alerts_total": self.n_alerts,
                "totals": self._totals(), "recent_refusals": list(self.recent),
                "rounds_done": len(self.rounds),
                "staleness": {str(k): v for k, v in sorted((self.staleness_done + self.staleness_live).items())},
            }
            if rounds_after is not None:
                out["rounds_after"] = rounds_after
                out["rounds"] = self.rounds[rounds_after:]
        return out


def _finite(o: Any) -> Any:
    """NaN and infinities -> None (JSON has none)."""
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def fan_out(*callbacks: Callable[[str, dict[str, Any]], None] | None) -> Callable[[str, dict[str, Any]], None]:
    """One ``on_event`` callback calling each of ``callbacks`` (None ones left out) in order."""
    cbs = [c for c in callbacks if c is not None]

    def call(event: str, fields: dict[str, Any]) -> None:
        for c in cbs:
            c(event, fields)

    return call


class LiveFile:
    """Writes ``monitor``'s picture to ``run_dir/live.json`` (atomically: a temporary file,
    then rename) after changes, at most once every ``interval`` s, from its own thread;
    :meth:`close` writes the final state. The file names this process (``pid``, ``host``)
    so that ``fedbit status`` can tell a running job from one that died."""

    def __init__(self, monitor: FleetMonitor, run_dir: str | Path, *, interval: float = 1.0) -> None:
        self.monitor = monitor
        self.path = Path(run_dir) / LIVE_FILE
        self.interval = interval
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self.errors = 0
        monitor.add_listener(self._dirty.set)
        self._thread = threading.Thread(target=self._loop, name="fedbit-live-file", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            self._dirty.clear()
            self.write()
            self._stop.wait(self.interval)

    def write(self) -> None:
        """Write the file now (an OSError is counted, never raised: the job goes on)."""
        snap = self.monitor.snapshot(rounds_after=None)
        snap |= {"pid": os.getpid(), "host": socket.gethostname(), "updated": time.time()}
        tmp = self.path.with_name(f".{LIVE_FILE}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8", opener=private_opener) as f:
                f.write(json.dumps(snap, default=str))
            os.replace(tmp, self.path)
        except OSError:
            self.errors += 1

    def close(self) -> None:
        """Stop the thread and write the final picture."""
        self._stop.set()
        self._dirty.set()
        self._thread.join(timeout=5)
        self.write()
