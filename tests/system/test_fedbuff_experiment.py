"""experiments/fedbuff.py reads finished runs into its figures: the arm chosen per mode on
the validation split, the time to the synchronous run's final test accuracy, the speed-up
and the result files named after the config. Runs made up here with known curves, so
every figure has a value to equal."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from coordinator.emulation.config import expand_sweep, load_config, run_slug

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("fedbuff_experiment", ROOT / "experiments" / "fedbuff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(folder: Path, times: list[float], test: list[float], val: list[float], mb: float) -> None:
    """A run folder as the emulator leaves it: one scoring per record, ``mb`` MB of
    accepted uplink per record, two groups with the same figures."""
    (folder / "out").mkdir(parents=True)
    lines = []
    for t, a, v in zip(times, test, val, strict=True):
        groups = {g: {"accuracy": a, "val_accuracy": v} for g in ("int8", "float32")}
        lines.append(json.dumps({"sim_time": t, "groups": groups, "uplink_bytes": {"d0": int(mb * 1e6)}}))
    (folder / "out" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "emulation.json").write_text(json.dumps({"availability": None}))


def test_figures_of_made_up_runs_and_the_files_named_after_the_config(tmp_path: Path) -> None:
    config = tmp_path / "fb-check.toml"
    config.write_text(f'extends = "{(ROOT / "experiments" / "fedbuff.toml").as_posix()}"\n'
                      'name = "fb-check"\n[clock]\nuntil_s = 10.0\n')
    cfg = load_config(config)
    times = [float(t) for t in range(1, 11)]
    out, results = tmp_path / "runs", tmp_path / "results"
    for combo, _ in expand_sweep(cfg):
        arm = str(combo["arm"])
        for seed in (0, 1, 2, 7, 8):
            if arm == "sync d0.5 q1":  # the best synchronous arm on validation: 0.1 a second to 0.8
                test = [min(0.8, 0.1 * t) for t in times]
                val = [v + 0.05 for v in test]
            elif arm == "buffered K8 lr1":  # the best buffered arm: 0.2 a second, then flat
                test = [min(0.9, 0.2 * t) for t in times]
                val = [v + 0.05 for v in test]
            else:  # every other arm scores lower on validation (and better on test: not read)
                test, val = [0.99] * len(times), [0.1] * len(times)
            _write_run(out / "runs" / run_slug(combo) / f"seed-{seed}", times, test, val, mb=1.0)
    fedbuff = _script()
    assert fedbuff.main(["--config", str(config), "--analyse", str(out), "--results", str(results),
                         "--seeds", "0", "1", "2", "--tuning-seeds", "7", "8"]) == 0
    a = json.loads((results / "fb-check-speedup.json").read_text())
    assert a["chosen"] == {"sync": "sync d0.5 q1", "buffered": "buffered K8 lr1"}
    assert a["tuning_seeds"] == [7, 8] and a["config"].endswith("fb-check.toml")
    # the synchronous final accuracy (the last 10 % of 10 s: the scoring at 9 and 10 s) is
    # 0.8, reached at 8 s; the buffered run reaches it at 4 s, with 4 of 8 records' bytes
    for seed in ("0", "1", "2"):
        v = a["per_seed"][seed]
        assert v["target"] == pytest.approx(0.8) and v["sync_time"] == 8.0 and v["buffered_time"] == 4.0
        assert v["speedup"] == pytest.approx(2.0) and v["bytes_ratio"] == pytest.approx(0.5)
        assert v["buffered_final"] == pytest.approx(0.9)
    assert a["figures"]["speedup"]["mean"] == pytest.approx(2.0) and a["reached"] == {
        "sync": 3, "buffered": 3, "seeds": 3}
    text = (results / "fb-check-speedup.md").read_text()
    assert "fb-check.toml" in text and "seeds 7, 8: apart from the reported ones" in text
    assert "+10.00 points" in text and (results / "fb-check-speedup.png").stat().st_size > 0
    assert a["ended_early"] == {"sync": [], "buffered": []} and "Ended before the budget" not in text
    # both rise over the first half of the budget: cut while climbing, by the rule
    assert a["still_climbing"] | {"window": 5} == {"sync": 3, "buffered": 3, "unknown": 0, "window": 5,
                                                   "min_delta": 0.005}
    assert "(a fixed time budget, not a plateau)" in text


def test_a_run_its_bound_on_rounds_ended_early_is_named(tmp_path: Path) -> None:
    fedbuff = _script()
    runs = {}
    for arm, last in (("s", 10.0), ("b", 6.0)):
        runs[arm] = {0: tmp_path / arm / "seed-0"}
        times = [t for t in (2.0, 4.0, 6.0, 8.0, 10.0) if t <= last]
        _write_run(runs[arm][0], times, [0.5] * len(times), [0.5] * len(times), mb=1.0)
    a = fedbuff.analyse(runs, {"sync": "s", "buffered": "b"}, {"s": 0.5, "b": 0.5}, 10.0)
    assert a["ended_early"] == {"sync": [], "buffered": [0]}
    text = fedbuff.report(a, tmp_path)
    assert "**Ended before the budget**" in text and "buffered: seeds 0" in text
    # 5 scorings and 3: too few to say whether they climb (the rule compares two windows of 5)
    assert a["still_climbing"] == {"sync": 0, "buffered": 0, "unknown": 2, "window": 5, "min_delta": 0.005}
    assert "too few scorings to say in 2 runs" in text and "at a plateau" not in text
