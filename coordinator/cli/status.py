"""``fedbit status RUN_DIR``: the dashboard's picture in the terminal (rich tables), for a
running or a finished job (:func:`coordinator.ops.dashboard.runview.run_view`)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any


def add_status_command(sub: Any) -> None:
    p = sub.add_parser("status", help="a job's state, devices and rounds (running or finished)",
                       description="The state of a job from its run folder (a `fedbit serve --out` folder or a "
                                   "`fedbit emulate` run folder): running or not, the round in progress, the "
                                   "devices (online, last seen, last update, refusals), the last rounds and the "
                                   "totals. Reads files only; works while the job runs.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (fedbit serve --out, a fedbit emulate run "
                   "folder, or any folder inside one)")
    p.add_argument("--rounds", type=int, default=10, metavar="N", help="last N rounds in the table (default 10)")
    p.add_argument("--json", action="store_true", help="the same picture as one JSON object")
    p.set_defaults(func=_cmd_status)


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from coordinator.ops.dashboard.runview import run_view
    from edge_client.errors import ConfigError

    try:
        if args.rounds < 0:
            raise ConfigError(f"--rounds: must be >= 0, got {args.rounds}")
        view = run_view(args.run_dir)
    except ConfigError as exc:
        print(f"fedbit status: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(view, default=str))
        return 0
    render(view, last=args.rounds)
    return 0


def _pct(v: Any) -> str:
    return f"{100 * v:.1f}%" if isinstance(v, int | float) and math.isfinite(v) else "n/a"


def _bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _ago(t: Any) -> str:
    if not isinstance(t, int | float) or t <= 0:
        return "-"
    d = max(0.0, time.time() - t)
    return f"{d:.0f} s ago" if d < 120 else f"{d / 60:.0f} min ago" if d < 7200 else f"{d / 3600:.0f} h ago"


def outstanding_lines(cur: dict[str, Any]) -> list[str]:
    """The open round's selected devices still waited for, and those gone before answering
    (by id; a long list ends with how many more)."""
    out = []
    n, ids = int(cur.get("outstanding") or 0), list(cur.get("outstanding_ids") or [])
    if n:
        more = f" and {n - len(ids)} more" if n > len(ids) else ""
        out.append(f"  waiting for {n} device(s): {', '.join(ids)}{more}")
    gone = cur.get("gone") or {}
    if gone:
        out.append(f"  gone before answering (stragglers): {', '.join(f'{d} ({w})' for d, w in sorted(gone.items()))}")
    return out


def render(view: dict[str, Any], *, last: int = 10, console: Any = None) -> None:
    """Print ``view`` as rich tables (80+ columns; 140 when not on a terminal)."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console(width=None if sys.stdout.isatty() else 140, highlight=False)
    job, rounds = view["job"], view["rounds"]
    colour = {"running": "blue", "done": "green"}.get(view["state"], "red")
    title = view.get("title") or f"job {job.get('job', '?')}: {job.get('model', '?')}, {job.get('strategy', '?')}"
    planned = view["rounds_planned"] or "?"
    con.print(f"[bold]{title}[/bold]  [{colour}]{view['state']}[/{colour}] ({view['why']}); "
              f"{len(rounds)} of {planned} rounds completed; run folder {view['run_dir']}")
    if view.get("dashboard") and view["state"] == "running":
        con.print(f"dashboard: {view['dashboard']}")
    cur = view.get("current")
    if cur:
        if cur.get("phase") == "waiting" and cur.get("need"):
            con.print(f"round {cur.get('round', 0) + 1}: waiting for devices, {cur.get('present', 0)} of "
                      f"{cur['need']} present")
        elif cur.get("phase") == "buffering":
            con.print(f"version {cur.get('version', 0)}: {cur.get('fill', 0)} of {cur.get('size', 0)} updates "
                      f"buffered, {cur.get('in_flight', 0)} device(s) training")
        elif cur.get("phase") == "collecting":
            left = max(0.0, float(cur.get("deadline") or 0) - time.time())
            con.print(f"round {cur['round']}: collecting, {cur.get('received', 0)} of {cur.get('selected', 0)} "
                      f"updates, deadline in {left:.0f} s")
            for line in outstanding_lines(cur):
                con.print(line, markup=False, highlight=False)
        elif cur.get("round"):
            con.print(f"round {cur['round']}: closed, {cur.get('stragglers', 0)} straggler(s)")

    groups = sorted({g for r in rounds for g in r.get("groups", {})}, key=lambda g: (g != "float32", g))
    t = Table(title=f"last {min(last, len(rounds))} of {len(rounds)} rounds (accuracy of each bitwidth group's "
              "model)", title_justify="left")
    for col in ("round", *groups, "updates", "stragglers", "round s", "waited s", "uplink"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rounds[-last:] if last else []:
        t.add_row(str(r["round"]), *[_pct(r["groups"].get(g)) for g in groups],
                  f"{r['accepted']}/{r['selected']}", str(r["stragglers"]),
                  f"{r['round_seconds']:.2f}" if isinstance(r["round_seconds"], int | float) else "-",
                  f"{r['wait_seconds'] or 0:.2f}", _bytes(sum(r["uplink_bytes"].values())))
    if last and rounds:
        con.print(t)

    devs = view["devices"]
    running = view["state"] == "running"
    total = view.get("devices_total") or len(devs)
    shown = f"; the first {len(devs)} by id" if len(devs) < total else ""
    t = Table(title=(f"devices: {view.get('online', 0)} online of {total}" if running else f"devices: {total}")
              + shown, title_justify="left")
    cols = ("device", "status", "profile", "model", "uplink", "last seen", "last update", "updates", "refusals")
    for col in cols if running else [c for c in cols if c != "status"]:
        t.add_column(col, justify="right" if col == "updates" else "left", no_wrap=col != "refusals")
    for d in devs:
        upd = (f"round {d['last_round']}" + (f": {_bytes(d['last_bytes'])} {d['last_codec']}" if d.get("last_bytes")
                                              else "")) if d.get("last_round") else "-"
        notes = {**d.get("refusals", {}), **{k.replace("_", " "): v for k, v in d.get("notes", {}).items()}}
        status = ["online" if d.get("online") else "offline" if d.get("registered", True) else "refused"] \
            if running else []
        t.add_row(d["device_id"], *status, d.get("profile", ""), d.get("variant", ""), d.get("codec", ""),
                  _ago(d.get("last_seen")), upd, str(d.get("updates", 0)),
                  ", ".join(f"{k} x{v}" for k, v in notes.items()) or "-")
    if devs:
        con.print(t)

    tot = view.get("totals") or {}
    parts = [f"{tot.get('accepted', 0)} updates accepted"]
    parts += [f"{k.replace('_', ' ')} {v}" for k, v in (tot.get("refused") or {}).items()]
    parts += [f"uplink {c} {_bytes(n)}" for c, n in (tot.get("uplink_bytes") or {}).items()]
    if tot.get("wait_seconds"):
        parts.append(f"{tot['wait_seconds']:.1f} s waited for devices")
    con.print("totals: " + "; ".join(parts))
