"""`make demo`'s command, run for real: `fedbit demo` emulates the bundled mixed fleet over
the embedded broker (mosquitto), keeps its run folder and prints the report's path."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.mosquitto
def test_fedbit_demo_runs_the_default_fleet_and_writes_its_report(mosquitto_bin: str, tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "fedbit"
    out = tmp_path / "demo"
    proc = subprocess.run([str(exe), "demo", "--out", str(out), "--set", "rounds=2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "20 devices" in text and "transport mqtt" in text  # it says what it runs
    assert re.search(r"report: \S+summary\.md", text) and str(out) in text
    summary = (out / "summary.md").read_text()
    for group in ("int6", "int8", "int16", "float32"):
        assert re.search(rf"\| {group} \| \d+\.\d%", summary), group
    assert (out / "accuracy.png").is_file() and (out / "bytes.png").is_file()
    assert len((out / "out" / "metrics.jsonl").read_text().splitlines()) == 2
    assert "embedded mosquitto" in (out / "emulation.json").read_text()
