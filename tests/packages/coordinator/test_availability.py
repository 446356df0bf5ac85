"""Device availability in the emulator (``[availability]``): the bundled diurnal model keeps
each profile near its target, a charging window keeps a battery device offline outside it,
a trace is read with errors naming the line, and a round only selects devices that are
online, on the simulated clock."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from coordinator.emulation.availability import (
    PROFILE_AVAILABILITY,
    Availability,
    ProfileAvailability,
    Sessions,
    profile_overrides,
    read_trace,
)
from coordinator.emulation.config import from_dict
from coordinator.emulation.emulator import Emulator
from coordinator.emulation.report import write_report
from edge_client.errors import ConfigError

CLOCK = {"seconds_per_sample": {"float32": 1e-4, "int16": 4e-5, "int8": 2e-5, "int6": 2e-5}}


def test_the_diurnal_model_tracks_each_profiles_target() -> None:
    devices = {f"{p}-{i}": p for p in PROFILE_AVAILABILITY for i in range(30)}
    av = Availability("diurnal", devices, seed=1, start_hour=0.0)
    times = np.arange(0, 2 * 86_400, 1800.0)
    counts = av.counts(times)
    for prof, online in counts.items():
        frac = np.asarray(online) / 30
        target = np.array([PROFILE_AVAILABILITY[prof].target((t / 3600) % 24) for t in times])
        assert abs(frac.mean() - target.mean()) < 0.12, prof  # (sessions lag the target by about one)
    zero = np.asarray(counts["raspberry-pi-zero-2w"])
    hours = (times / 3600) % 24
    assert zero[(hours >= 19) | (hours < 8)].max() == 0  # charging 8-18 h only (a session ends when it closes)
    assert zero[(hours >= 10) & (hours < 17)].mean() > 10
    again = Availability("diurnal", devices, seed=1, start_hour=0.0)
    assert again.counts(times) == counts  # the same seed, the same sessions
    assert Availability("diurnal", devices, seed=2, start_hour=0.0).counts(times) != counts


def test_sessions_answer_online_session_end_and_changes() -> None:
    s = Sessions([(10.0, 20.0), (30.0, math.inf)])
    assert [s.online(t) for t in (0, 10, 19.9, 20, 35)] == [False, True, True, False, True]
    assert s.session_end(15) == 20 and s.next_change(0) == 10 and s.next_change(15) == 20 and s.next_change(31) == math.inf
    av = Availability("trace", {"a": "p", "b": "p"}, trace={"a": [(10.0, 20.0)]})
    assert av.offline_at(0) == ["a"] and av.changes(0, 25) == [(10.0, "a", True), (20.0, "a", False)]
    assert av.online("b", 1e9) and av.session_end("b", 5) == math.inf  # not in the trace: always online
    assert Availability("none", {"a": "p"}).always


def test_a_trace_with_a_bad_row_is_refused_by_line(tmp_path: Path) -> None:
    f = tmp_path / "t.csv"
    f.write_text("device,start,end\nd1,0,10\nd1,5,30\nd2,40,50\n")
    assert read_trace(f, ["d1", "d2"]) == {"d1": [(0.0, 30.0)], "d2": [(40.0, 50.0)]}
    for body, why in (("d1,0,10\nd9,1,2\n", r"t\.csv:2: 'd9' is not a device"),
                      ("d1,0,10\nd1,x,2\n", r"t\.csv:2: start and end must be numbers"),
                      ("d1,5,5\n", r"t\.csv:1: need 0 <= start < end"), ("d1,1\n", "expected device,start,end")):
        f.write_text(body)
        with pytest.raises(ConfigError, match=why):
            read_trace(f, ["d1", "d2"])
    with pytest.raises(ConfigError, match="availability.profiles.desktop: unknown key"):
        profile_overrides({"desktop": {"uptime": 1}}, "x.toml")
    with pytest.raises(ConfigError, match="charging"):
        profile_overrides({"desktop": {"charging": [3, 3]}}, "x.toml")
    assert profile_overrides({"desktop": {"availability": 0.3}}, "x")["desktop"] == \
        ProfileAvailability(0.3, 0.45, 14.0, 7200.0)


def test_a_round_selects_only_devices_online_on_the_simulated_clock(tmp_path: Path) -> None:
    """A trace takes desktop-1 offline from 0.01 to 0.5 simulated s: the rounds that start
    in that window do not select it, the report plots availability against time. The model
    is scored once per 0.2 simulated s (``eval_every_s``): the other rounds have no accuracy."""
    trace = tmp_path / "trace.csv"
    trace.write_text("device,start,end\ndesktop-1,0,0.01\ndesktop-1,0.5,1000\n")
    cfg = from_dict({"name": "av", "model": "mlp", "rounds": 4, "transport": "inproc",
                     "devices": {"raspberry-pi-4": 1, "desktop": 2}, "data": {"partition": "iid"},
                     "train": {"steps": 2, "batch": 16}, "round": {"workers": 1},
                     "availability": {"model": "trace", "trace": str(trace)},
                     "clock": CLOCK | {"eval_every_s": 0.2}}, "test")
    res = Emulator(cfg, 0, tmp_path / "run").run()
    hist = res.history
    assert hist[0]["selected_ids"] == ["desktop-0", "desktop-1", "raspberry-pi-4-0"]  # online at 0
    starts = [0.0] + [h["sim_time"] for h in hist[:-1]]
    for start, h in zip(starts, hist, strict=True):
        assert ("desktop-1" in h["selected_ids"]) == (start < 0.01 or start >= 0.5), (start, h["selected_ids"])
    assert any("desktop-1" not in h["selected_ids"] for h in hist)
    assert res.info["availability"]["online"]["desktop"][0] == 2
    scored = [h["sim_time"] for h in hist if h["accuracy"] is not None]
    assert hist[0]["accuracy"] is not None and len(scored) < len(hist)  # (0.2 s apart, rounds are shorter)
    assert len({math.floor(t / 0.2) for t in scored}) == len(scored)  # at most one per 0.2 s
    summary = write_report(res.run_dir).read_text()
    assert "## Device availability" in summary and (res.run_dir / "availability.png").stat().st_size > 5_000
