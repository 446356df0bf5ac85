"""The emulator: a mixed fleet learns in every bitwidth group; the same seed gives the same
metrics; the simulated clock makes slow and lossy devices stragglers; reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.emulation.config import from_dict
from coordinator.emulation.emulator import Emulator
from coordinator.emulation.experiment import run_experiment
from coordinator.emulation.report import write_report

#: pinned compute model (s per sample): runs are bit-reproducible and the test does not
#: spend time calibrating
CLOCK = {"seconds_per_sample": {"float32": 1e-4, "int16": 4e-5, "int8": 2e-5, "int6": 2e-5}}
#: record fields measured in wall time (differ between runs by nature)
WALL = {"time", "run", "round_seconds", "wait_seconds", "collect_seconds", "aggregate_seconds", "coordinator_seconds",
        "coordinator_cpu_seconds", "eval_seconds", "announce_seconds", "handle_seconds",
        "checkpoint_seconds", "device_train_seconds", "device_wall_seconds", "health_seconds"}


def config(**over) -> object:
    """A small mixed fleet; one worker (this process) unless ``round.workers`` says otherwise
    (tests/packages/coordinator/test_emulator_workers.py runs worker processes and Ray)."""
    raw = {"name": "t", "model": "digits_cnn", "rounds": 3, "strategy": "fedavg", "transport": "inproc",
           "devices": {"raspberry-pi-zero-2w": 2, "raspberry-pi-4": 2, "raspberry-pi-5": 2, "jetson-nano": 2,
                       "desktop": 2},
           "data": {"partition": "iid"}, "train": {"epochs": 2, "batch": 32},
           "round": {"deadline_s": 5.0, "workers": 1}, "clock": CLOCK}
    for k, v in over.items():  # sections are merged, the fleet is replaced
        raw[k] = raw.get(k, {}) | v if isinstance(v, dict) and k != "devices" else v
    return from_dict(raw, "test")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixed_fleet_learns_in_every_bitwidth_group(tmp_path: Path) -> None:
    """10 devices (Int6, Int8 x2 codecs, Int16, float32), IID digits, FedAvg, 20 rounds:
    measured 88-92% for every group's model in its own forward (seed 0); the bar is 85%."""
    res = Emulator(config(rounds=20), 0, tmp_path / "run").run()
    hist = res.history
    assert len(hist) == 20 and all(h["aggregated"] for h in hist)
    groups = {g for h in hist for g in h["groups"]}
    assert groups == {"int6", "int8", "int16", "float32"}
    for g in groups:
        acc = [h["groups"][g]["accuracy"] for h in hist]
        assert acc[0] < 0.6 and max(acc) >= 0.85 and acc[-1] >= 0.8, (g, acc)
    # every codec of the fleet was counted, and the simulated clock moved forward
    assert set(hist[-1]["uplink_bytes"]) == {"int-8", "kmeans-4", "asym-8", "float32-32"}
    sim = [h["sim_time"] for h in hist]
    assert all(b > a for a, b in zip(sim, sim[1:], strict=False)) and res.info["sim_seconds"] == sim[-1]
    summary = write_report(tmp_path / "run").read_text()
    for g in groups:
        assert f"| {g} |" in summary
    assert (tmp_path / "run" / "accuracy.png").stat().st_size > 10_000
    assert (tmp_path / "run" / "bytes.png").stat().st_size > 5_000


def test_the_same_seed_gives_the_same_metrics(tmp_path: Path) -> None:
    cfg = config(rounds=2, devices={"raspberry-pi-4": 2, "jetson-nano": 1, "desktop": 1},
                 data={"partition": "dirichlet", "alpha": 0.5})
    a = records(Emulator(cfg, 3, tmp_path / "a").run().run_dir)
    b = records(Emulator(cfg, 3, tmp_path / "b").run().run_dir)
    c = records(Emulator(cfg, 4, tmp_path / "c").run().run_dir)
    strip = lambda rs: [{k: v for k, v in r.items() if k not in WALL} for r in rs]  # noqa: E731
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)
    split_a = json.loads((tmp_path / "a" / "emulation.json").read_text())["devices"]
    split_c = json.loads((tmp_path / "c" / "emulation.json").read_text())["devices"]
    assert [d["class_counts"] for d in split_a] != [d["class_counts"] for d in split_c]


def test_slow_and_lossy_devices_are_stragglers_on_the_simulated_clock(tmp_path: Path) -> None:
    """Pi Zero 2 W devices take 144 samples x 0.01 s / 0.08 = 18 simulated s to train: past
    the 5 s deadline every round. A profile losing half its messages drops out in some
    rounds. Rounds with stragglers last exactly the deadline; the others end at the last
    arrival."""
    lossy = tmp_path / "lossy.toml"
    lossy.write_text((Path(__file__).parents[3] / "hw_profiles" / "profiles" / "desktop.toml").read_text()
                     .replace('name = "desktop"', 'name = "lossy"').replace("loss_rate = 0.0", "loss_rate = 0.5"))
    cfg = config(rounds=4, devices={"raspberry-pi-zero-2w": 2, "raspberry-pi-4": 2, str(lossy): 4},
                 clock={"seconds_per_sample": CLOCK["seconds_per_sample"] | {"int6": 1e-2}})
    hist = Emulator(cfg, 0, tmp_path / "run").run().history
    for h in hist:
        assert h["sim_late_ids"] == ["raspberry-pi-zero-2w-0", "raspberry-pi-zero-2w-1"]
        assert h["sim_round_seconds"] == 5.0 and h["stragglers"] == 2 + h["sim_dropouts"]
        assert set(h["straggler_ids"]) == set(h["sim_late_ids"]) | set(h["sim_dropout_ids"])
        assert h["accepted"] == 8 - h["stragglers"] and "raspberry-pi-zero-2w-0" not in h["accepted_ids"]
    assert 0 < sum(h["sim_dropouts"] for h in hist) < 16  # p = 0.5 over 4 devices x 4 rounds
    assert hist[-1]["sim_time"] == pytest.approx(20.0)
    # no deadline: the round ends at the last arrival, the slow devices count
    hist = Emulator(config(rounds=1, devices={"raspberry-pi-zero-2w": 1, "desktop": 1},
                           round={"deadline_s": 0.0},
                           clock={"seconds_per_sample": CLOCK["seconds_per_sample"] | {"int6": 1e-2}}),
                    0, tmp_path / "run2").run().history
    assert hist[0]["accepted"] == 2 and hist[0]["sim_round_seconds"] > 18


def test_quorum_closes_at_the_fastest_arrivals(tmp_path: Path) -> None:
    cfg = config(rounds=1, devices={"raspberry-pi-zero-2w": 2, "desktop": 2}, round={"quorum": 0.5})
    h = Emulator(cfg, 0, tmp_path / "run").run().history[0]
    assert h["accepted_ids"] == ["desktop-0", "desktop-1"]  # relative speed 1.0 vs 0.08
    assert sorted(h["sim_late_ids"]) == ["raspberry-pi-zero-2w-0", "raspberry-pi-zero-2w-1"]


def test_seeds_write_one_report_with_mean_and_std(tmp_path: Path) -> None:
    cfg = config(rounds=1, seeds=[0, 1], devices={"raspberry-pi-4": 1, "desktop": 1})
    summary = run_experiment(cfg, tmp_path / "sweep", echo=lambda _m: None)
    text = summary.read_text()
    assert "| default | 2 |" in text and "±" in text
    results = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert len(results) == 2 and {r["seed"] for r in results} == {0, 1}
    assert (tmp_path / "sweep" / "runs" / "default" / "seed-1" / "summary.md").is_file()
    # a run folder of the sweep: its summary lists its ONNX files; `fedbit export` and
    # `fedbit report` take it as they take a `fedbit serve --out` folder
    import importlib.util

    from coordinator.cli import main as fedbit

    run = tmp_path / "sweep" / "runs" / "default" / "seed-1"
    if importlib.util.find_spec("onnx") is not None:
        assert "`out/onnx/int8.onnx`" in (run / "summary.md").read_text()
        (run / "out" / "onnx" / "int8.onnx").unlink()
        assert fedbit(["export", str(run), "--bits", "8"]) == 0
        assert (run / "out" / "onnx" / "int8.onnx").is_file() and not (run / "onnx").exists()
    (run / "summary.md").unlink()
    assert fedbit(["report", str(run)]) == 0 and (run / "summary.md").is_file()
