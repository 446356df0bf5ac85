"""An interrupted sweep goes on where it stopped (``--resume``): finished runs of the same
combination and seed are kept as they are, a run cut off part-way is made again from its
first round, and the reports cover every run. A real ``fedbit emulate`` killed with
SIGKILL between two runs, then resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from coordinator.emulation.config import expand_sweep, from_dict
from coordinator.emulation.experiment import finished_run, run_experiment

BIN = Path(sys.executable).parent
CLOCK = {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5}}
TOML = """name = "resume"
model = "digits_cnn"
rounds = 2
seeds = [0, 1]
transport = "inproc"
clock = {seconds_per_sample = {float32 = 1e-4, int8 = 2e-5}}
[devices]
raspberry-pi-4 = 1
desktop = 1
[train]
steps = 3
[sweep]
strategy = ["fedavg", "fedshift"]
"""


def raw(**over) -> dict:
    base = {"name": "resume", "model": "digits_cnn", "rounds": 2, "seeds": [0, 1], "transport": "inproc",
            "devices": {"raspberry-pi-4": 1, "desktop": 1}, "train": {"steps": 3}, "clock": CLOCK,
            "sweep": {"strategy": ["fedavg", "fedshift"]}}
    return base | over


def accuracies(run_dir: Path) -> list[dict]:
    lines = (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["groups"] for x in lines if x.strip()]


def test_a_resumed_sweep_keeps_finished_runs_and_remakes_the_cut_one(tmp_path: Path) -> None:
    cfg = from_dict(raw(), "t")
    out = tmp_path / "sweep"
    run_experiment(cfg, out, echo=lambda _m: None)
    runs = sorted(p.parent for p in out.glob("runs/*/seed-*/emulation.json"))
    assert len(runs) == 4
    first = {r: accuracies(r) for r in runs}
    kept, cut, gone = runs[0], runs[1], runs[2]
    stamp = (kept / "out" / "metrics.jsonl").stat().st_mtime_ns
    lines = (cut / "out" / "metrics.jsonl").read_text().splitlines()
    (cut / "out" / "metrics.jsonl").write_text(lines[0] + "\n")  # cut off after its first round
    import shutil

    shutil.rmtree(gone)
    said: list[str] = []
    summary = run_experiment(cfg, out, echo=said.append, resume=True)
    assert sum("finished before, kept" in m for m in said) == 2, said
    assert (kept / "out" / "metrics.jsonl").stat().st_mtime_ns == stamp  # not made again
    for r in runs:  # the remade runs are the runs the first invocation made (one seed, one run)
        assert accuracies(r) == first[r], r
    results = json.loads((out / "results.json").read_text())
    assert len(results) == 4 and all(x["rounds"] == 2 for x in results)
    assert "4 run(s)" in summary.read_text()


def test_finished_run_compares_the_config_the_seed_and_the_rounds(tmp_path: Path) -> None:
    cfg = from_dict(raw(sweep={}, seeds=[0]), "t")
    run_dir = tmp_path / "one"
    run_experiment(cfg, run_dir, echo=lambda _m: None)
    (c,) = [c for _, c in expand_sweep(cfg)]
    assert finished_run(run_dir, c, 0)
    assert not finished_run(run_dir, c, 1)  # another seed
    assert finished_run(run_dir, from_dict(raw(sweep={}, seeds=[0, 1, 2]), "t"), 0)  # more seeds: same run
    assert finished_run(run_dir, from_dict(raw(sweep={}, seeds=[0], name="part-b"), "t"), 0)  # a label only
    assert not finished_run(run_dir, from_dict(raw(sweep={}, seeds=[0], rounds=3), "t"), 0)
    assert not finished_run(run_dir, from_dict(raw(sweep={}, seeds=[0], train={"steps": 4}), "t"), 0)
    assert not finished_run(run_dir, from_dict(raw(sweep={}, seeds=[0], strategy="fedshift"), "t"), 0)
    info = json.loads((run_dir / "emulation.json").read_text())
    del info["wall_seconds"]  # the description a run writes when it starts
    (run_dir / "emulation.json").write_text(json.dumps(info))
    assert not finished_run(run_dir, c, 0)
    (run_dir / "emulation.json").write_text("{not json")
    assert not finished_run(run_dir, c, 0)
    assert not finished_run(tmp_path / "nothing-here", c, 0)


def test_emulate_resume_after_a_kill_between_runs(tmp_path: Path) -> None:
    """``fedbit emulate`` killed with SIGKILL once its second run has started; ``--resume``
    keeps the first run and makes the other three; without ``--resume`` the non-empty
    folder is refused, and ``--resume`` without ``--out`` too."""
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(TOML)
    out = tmp_path / "em"
    exe = str(BIN / "fedbit")
    proc = subprocess.Popen([exe, "emulate", str(cfg), "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if line.startswith("run 2/4"):
                break
        assert seen[-1].startswith("run 2/4"), seen
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    refused = subprocess.run([exe, "emulate", str(cfg), "--out", str(out)], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 1 and "--resume" in refused.stderr, refused.stderr
    no_out = subprocess.run([exe, "emulate", str(cfg), "--resume"], capture_output=True, text=True, timeout=120)
    assert no_out.returncode == 1 and "--resume needs the --out" in no_out.stderr, no_out.stderr
    done = subprocess.run([exe, "emulate", str(cfg), "--out", str(out), "--resume", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    kept = [ln for ln in done.stdout.splitlines() if ln.endswith("finished before, kept")]
    assert len(kept) == 1 and kept[0].startswith("run 1/4"), done.stdout
    results = json.loads((out / "results.json").read_text())
    assert len(results) == 4 and all(r["rounds"] == 2 for r in results)
