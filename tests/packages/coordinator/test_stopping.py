"""Runs to a plateau: the rule on the validation curve, a run that stops at it and reports
the rounds after it (the only ones that read the test split), the flag on a run still
climbing, and the configs that cannot stop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from coordinator.emulation.config import from_dict
from coordinator.emulation.emulator import Emulator
from coordinator.emulation.experiment import finished_run
from coordinator.emulation.report import summarize_run
from coordinator.emulation.stopping import climbing, run_curve
from edge_client.errors import ConfigError

CLOCK = {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5}}


def raw(**over) -> dict:
    base = {"name": "st", "model": "digits_cnn", "rounds": 12, "strategy": "fedavg",
            "devices": {"raspberry-pi-4": 1, "desktop": 1}, "data": {"partition": "iid", "validation": 0.2},
            "train": {"steps": 2, "batch": 16}, "round": {"workers": 1}, "clock": CLOCK}
    return base | over


def test_the_rule_compares_the_last_window_with_the_one_before() -> None:
    rising = [0.1 * r for r in range(1, 11)]
    assert climbing(rising, 3, 0.005) is True and climbing(rising[:5], 3, 0.005) is None
    flat = [0.5, 0.6, 0.7, 0.8, 0.8, 0.803, 0.805]
    assert climbing(flat, 2, 0.005) is False and climbing(flat, 2, 0.0) is True  # +0.4 points
    assert climbing([math.nan, 0.3, 0.3, 0.3, 0.3], 2, 0.0) is False  # rounds without figures skipped
    records = [{"groups": {"int8": {"val_accuracy": 0.4}, "float32": {"val_accuracy": 0.6, "accuracy": 0.9}}}]
    assert run_curve(records) == [pytest.approx(0.5)]


def test_a_run_stops_at_its_plateau_and_reports_the_rounds_after_it(tmp_path: Path) -> None:
    # min_delta 1: never climbing, so the plateau is the first round the rule may look at
    cfg = from_dict(raw(stop={"plateau": True, "window": 1, "min_delta": 1.0, "min_rounds": 2}), "t")
    hist = Emulator(cfg, 0, tmp_path / "run").run().history
    assert [h["round"] for h in hist] == list(range(1, 8))  # plateau at 2, then 5 reported rounds
    for h in hist:
        reported = h["round"] >= 3
        for g in h["groups"].values():
            assert (g["accuracy"] is not None) == reported, h["round"]  # the test split: reported rounds only
    info = json.loads((tmp_path / "run" / "emulation.json").read_text())
    assert info["stop"]["plateau_round"] == 2 and info["stop"]["rounds"] == 7
    assert finished_run(tmp_path / "run", cfg, 0)
    s = summarize_run(info, hist)
    assert s["stop"]["plateau_round"] == 2 and s["stop"]["split"] == "validation"
    assert all(math.isfinite(g["mean_last"]) for g in s["groups"].values())


def test_a_run_without_a_plateau_runs_its_rounds_and_says_whether_it_still_climbs() -> None:
    records = [{"round": r, "groups": {"int8": {"accuracy": 0.05 * r, "val_accuracy": 0.05 * r}}} for r in range(1, 13)]
    s = summarize_run({"config": {"stop": {"window": 3}}}, records)
    assert s["stop"] == {"rounds": 12, "plateau_round": None, "split": "validation", "climbing": True}
    no_val = [{"round": r, "groups": {"int8": {"accuracy": 0.5}}} for r in range(1, 13)]
    assert summarize_run({}, no_val)["stop"]["climbing"] is False
    assert summarize_run({}, no_val)["stop"]["split"] == "test"


def test_stopping_needs_a_validation_split_and_sane_settings() -> None:
    with pytest.raises(ConfigError, match="stop.plateau: the plateau is read on the validation split"):
        from_dict(raw(data={"partition": "iid"}, stop={"plateau": True}), "t")
    with pytest.raises(ConfigError, match="stop.window"):
        from_dict(raw(stop={"window": 0}), "t")
    with pytest.raises(ConfigError, match="stop.min_delta"):
        from_dict(raw(stop={"min_delta": -1}), "t")
    with pytest.raises(ConfigError, match="stop.bogus"):
        from_dict(raw(stop={"bogus": 1}), "t")


def test_a_round_without_the_test_split_shows_its_validation_accuracy() -> None:
    from coordinator.ops.logs import round_line

    rec = {"round": 3, "accepted": 2, "selected": 2, "round_seconds": 1.0, "accuracy": None,
           "groups": {"float32": {"accuracy": None, "val_accuracy": 0.5}, "int8": {"accuracy": None, "val_accuracy": 0.625}}}
    assert round_line(rec, 9).startswith("round 3/9: validation accuracy float32 0.5000 int8 0.6250,")
    rec["groups"]["int8"]["accuracy"] = 0.75
    assert round_line(rec, 9).startswith("round 3/9: accuracy float32 n/a int8 0.7500,")
