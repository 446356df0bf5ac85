"""`make demo`'s command, run for real: embedded broker, coordinator, device subprocesses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_fedbit_demo_runs_rounds_and_reports_accuracy(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "fedbit"
    proc = subprocess.run(
        [str(exe), "demo", "--rounds", "2", "--devices", "raspberry-pi-4,raspberry-pi-5,desktop",
         "--keep", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "fedbit demo: OK" in out
    assert "embedded" in out and "raspberry-pi-5" in out  # it says what it ran
    accs = [float(a) for a in re.findall(r"round \d/2: accuracy ([0-9.]+), 3/3 updates", out)]
    assert len(accs) == 2 and all(0.0 < a <= 1.0 for a in accs)
    metrics = (tmp_path / "run" / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2
