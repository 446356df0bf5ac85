"""Nothing a run decides reads the test split: an emulated run whose test split is poisoned
(every image the same, the labels shuffled) makes every decision the clean run makes (the
health record, the rollbacks, the validation figures, the final model), and only the
reported test figures move. A watch that read the test split would have acted on that
poison: it makes the probe's output constant, which is a collapse."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import coordinator.emulation.emulator as run_mod
from coordinator.emulation.config import from_dict
from coordinator.emulation.datasets import load_dataset
from coordinator.emulation.emulator import Emulator
from coordinator.health import HealthWatch
from coordinator.state import RunState
from edge_client.data import Dataset
from firmware_models import get_spec

CLOCK = {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5, "int6": 2e-5}}


def poisoned(split):
    """The split with a test set no decision may see: one image (all zeros) for every
    sample, the labels shuffled."""
    t = split.test
    y = np.random.default_rng(5).permutation(t.y)
    return replace(split, test=Dataset(np.zeros_like(t.x), y))


def run(tmp: Path, monkeypatch: pytest.MonkeyPatch, poison: bool) -> tuple[list[dict], list[np.ndarray]]:
    if poison:
        monkeypatch.setattr(run_mod, "load_dataset", lambda *a, **k: poisoned(load_dataset(*a, **k)))
    cfg = from_dict({"name": "nt", "model": "digits_cnn", "rounds": 2, "strategy": "fedavg",
                     "devices": {"raspberry-pi-4": 1, "raspberry-pi-zero-2w": 1, "desktop": 1},
                     "data": {"partition": "iid", "validation": 0.2}, "train": {"steps": 3, "batch": 16},
                     "round": {"workers": 1}, "clock": CLOCK}, "test")
    Emulator(cfg, 0, tmp).run()
    records = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    return records, RunState(tmp / "out").load_checkpoint().weights


def test_a_poisoned_test_split_changes_no_decision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean, w_clean = run(tmp_path / "clean", monkeypatch, poison=False)
    dirty, w_dirty = run(tmp_path / "dirty", monkeypatch, poison=True)
    assert len(clean) == len(dirty) == 2
    for a, b in zip(clean, dirty, strict=True):
        assert a["health"] == b["health"] and not b["health"]["collapse"] and not b["health"]["rolled_back"]
        assert a["weight_change_l2"] == b["weight_change_l2"]
        for g in a["groups"]:
            assert a["groups"][g]["val_accuracy"] == b["groups"][g]["val_accuracy"]
    for x, y in zip(w_clean, w_dirty, strict=True):
        np.testing.assert_array_equal(x, y)
    # the poison reached the reported figures, and would have made a test-reading watch act
    assert any(a["groups"][g]["accuracy"] != b["groups"][g]["accuracy"]
               for a, b in zip(clean, dirty, strict=True) for g in a["groups"])
    zeros = np.zeros((16, 1, 8, 8), np.float32)
    v = HealthWatch(get_spec("digits_cnn"), "log", probe=zeros).check(
        3, (w_dirty, {}), (w_dirty, {}), {"int8": (1.0, 0.1)}, [])
    assert any("constant function" in c for c in v.collapse)
