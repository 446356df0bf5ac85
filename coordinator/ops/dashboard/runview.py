"""The picture of a run directory, running or finished (``fedbit status``), read from its
files only: ``live.json`` (what the running coordinator's monitor last wrote: devices,
the open round, whether it is still running), ``metrics.jsonl`` (every completed round),
and for runs without ``live.json`` the device registry and the checkpoint.

A run is ``running`` while its ``live.json`` says so and the process it names is alive
(on this host; on another host, while the file is fresh), ``stopped`` when that process
is gone or the run ended early, ``done`` when every planned round completed.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from coordinator.ops.dashboard.monitor import DEVICE_ROWS, LIVE_FILE, round_summary
from coordinator.ops.rundir import coordinator_dir
from edge_client.protocol import model_variant

#: a ``live.json`` of another host older than this is taken for a stopped run (s)
STALE_S = 120.0


def read_live(run_dir: Path) -> dict[str, Any]:
    """``run_dir/live.json`` ({} when missing or unreadable: it is replaced atomically,
    so that is a run without one)."""
    try:
        data = json.loads((run_dir / LIVE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def served_info(run_dir: Path) -> dict[str, Any]:
    """A ``fedbit serve`` run's description for the reports: its job table (``config``,
    from ``live.json``; {} without one), ``title`` (``job farm: digits_cnn, fedavg``)."""
    live = read_live(run_dir)
    job = live.get("job") if isinstance(live.get("job"), dict) else {}
    if not job:
        return {}
    title = live.get("title") if isinstance(live.get("title"), str) else ""
    return {"config": job, "seed": job.get("seed", "?"),
            "title": title or f"job {job.get('job', '?')}: {job.get('model', '?')}, {job.get('strategy', '?')}"}


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash mid-write
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run_view(path: str | Path) -> dict[str, Any]:
    """The picture of the run in ``path`` (a ``serve --out`` folder or an emulated run
    folder): ``state``, ``why`` (one line), ``job``, ``rounds_planned``, ``rounds`` (compact
    records), ``current`` (the open round, running jobs only), ``devices``, ``totals``,
    ``dashboard``, ``updated`` (Unix s of ``live.json``, 0 without one)."""
    d = coordinator_dir(path)
    live = read_live(d)
    rounds = [round_summary(r) for r in _read_metrics(d / "metrics.jsonl")]
    view: dict[str, Any] = {"run_dir": str(d), "title": live.get("title", ""), "job": live.get("job") or {},
                            "rounds": rounds,
                            "rounds_planned": int(live.get("rounds_planned") or 0), "current": None,
                            "devices": live.get("devices") or [], "totals": live.get("totals") or {},
                            "devices_total": live.get("devices_total", 0), "online": live.get("online", 0),
                            "recent_refusals": live.get("recent_refusals") or [],
                            "dashboard": live.get("dashboard") or "", "updated": live.get("updated", 0)}
    if not live:
        _from_files(d, view)
    done = len(rounds)
    planned = view["rounds_planned"]
    state = live.get("state", "")
    if state in ("running", "starting"):
        here = live.get("host") == socket.gethostname()
        age = time.time() - float(live.get("updated") or 0)
        if (here and _alive(live.get("pid"))) or (not here and age < STALE_S):
            view["state"] = "running"
            view["why"] = f"pid {live.get('pid')} on {live.get('host')}, updated {age:.0f} s ago"
            view["current"] = live.get("current")
            return view
        view["state"] = "stopped"
        view["why"] = f"the coordinator (pid {live.get('pid')} on {live.get('host')}) is gone"
    elif state in ("done", "stopped", "error"):
        view["state"] = state
        view["why"] = {"done": "every round completed", "stopped": "stopped by a signal",
                       "error": "the coordinator stopped on an error (its log says which)"}[state]
    else:
        view["state"] = "done" if planned and done >= planned else "stopped" if done else "not started"
        view["why"] = "no live.json: read from the run's files"
    if view["state"] == "done" and planned and done < planned:
        view["state"], view["why"] = "stopped", f"{done} of {planned} rounds completed"
    return view


def _from_files(d: Path, view: dict[str, Any]) -> None:
    """Devices, totals and the plan of a run without ``live.json`` (from its registry,
    checkpoint and metrics)."""
    from coordinator.devices import state_entries, state_size
    from coordinator.state import CorruptFile, RunState

    state = RunState(d, durable=False)
    try:
        ckpt = state.load_checkpoint()
        hellos = state.load_devices() or (ckpt.devices if ckpt else {})
    except CorruptFile:
        ckpt, hellos = None, {}
    if ckpt is not None:
        view["rounds_planned"] = int(ckpt.config.get("rounds") or 0)
        view["job"] = view["job"] or {"job": ckpt.job, "model": ckpt.model,
                                      "strategy": ckpt.config.get("strategy", "")}
    last: dict[str, tuple[int, int]] = {}
    uplink: dict[str, int] = {}
    refused: dict[str, int] = {}
    for r in view["rounds"]:
        for codec, n in r["uplink_bytes"].items():
            uplink[codec] = uplink.get(codec, 0) + int(n)
        for k, n in r["counts"].items():
            refused[k] = refused.get(k, 0) + int(n)
    for rec in _read_metrics(d / "metrics.jsonl"):
        for dev in rec.get("accepted_ids") or []:
            n = last.get(dev, (0, 0))[1]
            last[dev] = (int(rec.get("round", 0)), n + 1)
    view["devices"] = [{"device_id": dev, "profile": h.get("profile", ""), "online": None,
                        "variant": model_variant(int(h.get("compute_bits", 32)), str(h.get("trainer", ""))),
                        "codec": f"{h.get('codec', '?')}-{h.get('codec_bits', '?')}", "last_seen": 0.0,
                        "updates": last.get(dev, (0, 0))[1], "last_round": last.get(dev, (None, 0))[0],
                        "last_bytes": 0, "last_codec": "", "refusals": {}, "notes": {}}
                       for dev, h in state_entries(hellos, DEVICE_ROWS)]
    view["devices_total"] = state_size(hellos)
    view["totals"] = {"rounds": len(view["rounds"]), "accepted": sum(int(r["accepted"]) for r in view["rounds"]),
                      "refused": refused, "uplink_bytes": uplink,
                      "wait_seconds": sum(float(r["wait_seconds"] or 0) for r in view["rounds"])}

