"""Per-device reputation: strikes, and the quarantine only the operator lifts.

A device *takes part* in a round when an update of its was accepted or refused for its
content; it gets a *strike* in that round when its update was norm-bounded by the guard
(:mod:`coordinator.defense.guard`), claimed more samples than its bound, or was refused
for its content (non-finite, malformed, wrong shapes, out of range, oversized). With
``strikes`` struck rounds among its last ``window`` rounds taken part in it is
**quarantined**: never selected again, named in the log, the metrics and the dashboard,
until ``fedbit release DEVICE --run DIR`` drops a request file in ``DIR/release/`` that
the coordinator reads before its next selection (or when it resumes): no signals, running
or stopped job alike. Strikes older than the window are forgotten; a released device
starts clean. The state is ``DIR/reputation.json`` (0600), written when it changes; memory
holds only the devices with a strike in their window and the quarantined ones.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from coordinator.state import atomic_write, private_opener
from edge_client.protocol import valid_id

log = logging.getLogger("fedbit.defense")

STATE_FILE = "reputation.json"
RELEASE_DIR = "release"
STATE_VERSION = 1
#: refusal reasons of an update that count as a strike (what the device sent was bad; not
#: a late, repeated or unauthenticated message, which others can cause)
STRIKE_REASONS = frozenset({"nonfinite", "malformed", "wrong_shape", "out_of_range", "oversized",
                            "too_many_samples"})


class Reputation:
    """See the module docstring. ``run_dir`` None: nothing is saved or read (tests)."""

    def __init__(self, strikes: int = 3, window: int = 5, run_dir: str | Path | None = None, *,
                 logger: logging.Logger | None = None) -> None:
        self.log = logger or log
        self.strikes = int(strikes)
        self.window = int(window)
        self.dir = Path(run_dir) if run_dir is not None else None
        #: device -> its last ``window`` rounds taken part in: [round, why struck or ""]
        self.recent: dict[str, list[list[Any]]] = {}
        #: device -> {"round", "at" (Unix s), "reasons"}
        self.quarantined: dict[str, dict[str, Any]] = {}
        self.changed = False

    # ------------------------------------------------------------------ rounds
    def record(self, round_id: int, took_part: Iterable[str], struck: Mapping[str, str]) -> list[str]:
        """Round ``round_id``'s outcome: the devices that took part, and why each struck one
        was; returns the devices quarantined now (each logged)."""
        new = []
        for dev in sorted(set(took_part) | set(struck)):
            why = struck.get(dev, "")
            hist = self.recent.get(dev)
            if hist is None and not why:
                continue  # (a clean record stays unstored)
            hist = (hist or []) + [[int(round_id), why]]
            hist = hist[-self.window:]
            self.changed = True
            if not any(w for _, w in hist):
                self.recent.pop(dev, None)
                continue
            self.recent[dev] = hist
            if self.strikes and dev not in self.quarantined and sum(1 for _, w in hist if w) >= self.strikes:
                reasons = [f"round {r}: {w}" for r, w in hist if w]
                self.quarantined[dev] = {"round": int(round_id), "at": time.time(), "reasons": reasons}
                self.recent.pop(dev, None)
                new.append(dev)
                self.log.warning("device %r quarantined after round %d (%s); it is not selected until released: "
                            "fedbit release %s --run RUN_DIR", dev, round_id, "; ".join(reasons), dev,
                            extra={"event": "quarantine", "device": dev, "round": round_id})
        return new

    def release(self, device_id: str) -> bool:
        """Lift ``device_id``'s quarantine (and forget its strikes); False when it was not
        quarantined."""
        if self.quarantined.pop(device_id, None) is None:
            return False
        self.recent.pop(device_id, None)
        self.changed = True
        self.log.warning("device %r released from quarantine by the operator", device_id,
                    extra={"event": "release", "device": device_id})
        return True

    def take_releases(self) -> list[str]:
        """Read (and remove) the operator's release requests; returns the devices released."""
        if self.dir is None:
            return []
        folder = self.dir / RELEASE_DIR
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            return []
        out = []
        for name in names:
            (folder / name).unlink(missing_ok=True)
            if valid_id(name) and self.release(name):
                out.append(name)
        return out

    # ------------------------------------------------------------------ state
    def to_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "recent": self.recent, "quarantined": self.quarantined}

    def save(self) -> None:
        """Write the state when it changed."""
        if self.dir is not None and self.changed:
            atomic_write(self.dir / STATE_FILE, json.dumps(self.to_state(), sort_keys=True).encode())
        self.changed = False

    def load(self) -> None:
        """Read a saved state (a resumed run); a missing file is a clean record, a damaged
        one is logged and taken as clean too (quarantines are then lost: said so)."""
        if self.dir is None:
            return
        path = self.dir / STATE_FILE
        try:
            st = json.loads(path.read_text())
            if st.get("version") != STATE_VERSION:
                raise ValueError(f"version {st.get('version')!r}")
            self.recent = {str(d): [[int(r), str(w)] for r, w in h] for d, h in st["recent"].items()}
            self.quarantined = {str(d): dict(q) for d, q in st["quarantined"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.log.error("%s: unreadable (%s); starting with no strikes and no quarantine", path, exc,
                      extra={"event": "corrupt", "path": str(path)})


def request_release(run_dir: str | Path, device_id: str) -> tuple[bool, dict[str, Any] | None]:
    """Ask the coordinator of ``run_dir`` to release ``device_id`` (a file in
    ``run_dir/release/``); returns (written, the device's quarantine record as last saved,
    None when it is not quarantined there)."""
    d = Path(run_dir)
    rep = Reputation(run_dir=d)
    rep.load()
    folder = d / RELEASE_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    with open(folder / device_id, "w", opener=private_opener):
        pass
    return True, rep.quarantined.get(device_id)
