"""The dashboard as an operator sees it: ``fedbit serve --dashboard`` over mosquitto with
two real ``fedbit-edge`` devices, the page open in headless Chromium (Debian's chromium and
chromedriver, driven by Selenium) for a whole 3-round run; ``fedbit status`` and
``/metrics`` on the running job, bad requests while it runs, and the operator's lines
(stdout and stderr not repeating each other)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import need_tool, wait_for

BIN = Path(sys.executable).parent
ENV = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1"}


def chromium(tmp: Path):
    """Headless Debian Chromium through its chromedriver (nothing downloaded)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = need_tool("chromium", "apt-get install chromium")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,1500",
                f"--user-data-dir={tmp / 'chromium-profile'}"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(need_tool("chromedriver", "apt-get install chromium-driver")),
                            options=opts)


@pytest.mark.slow
@pytest.mark.mosquitto
def test_the_dashboard_in_chromium_during_a_real_run(mosquitto, tmp_path: Path, capsys) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from coordinator.cli import main as fedbit

    out = tmp_path / "run"
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([str(BIN / args[0]), *args[1:]], stdout=open(tmp_path / f"{name}.out", "wb"),  # noqa: SIM115
                             stderr=open(tmp_path / f"{name}.err", "wb"), env=ENV)  # noqa: SIM115
        procs.append(p)
        return p

    def text(name: str, stream: str = "out") -> str:
        return (tmp_path / f"{name}.{stream}").read_text(errors="replace")

    def device(i: int, profile: str) -> subprocess.Popen:
        return start(f"dev{i}", "fedbit-edge", "run", "--broker", mosquitto.url, "--profile", profile, "--data",
                     f"digits:{i}/2", "--id", f"dev{i}", "--job", "dash", "--seed", str(i), "--workdir",
                     str(tmp_path / f"dev{i}"), "--max-seconds", "120")

    coord = start("coord", "fedbit", "serve", "--broker", mosquitto.url, "--model", "mlp", "--rounds", "3",
                  "--strategy", "fedavg", "--out", str(out), "--job", "dash", "--min-devices", "2",
                  "--round-timeout", "60", "--presence-timeout", "90", "--steps", "8", "--dashboard", "0")
    driver = chromium(tmp_path)
    try:
        url = wait_for(lambda: re.search(r"^dashboard: (http://127\.0\.0\.1:\d+/)", text("coord"), re.M), 60,
                       "the dashboard's URL").group(1)
        driver.get(url)
        js = lambda expr: driver.execute_script(f"return window.fedbitDashboard.{expr}")  # noqa: E731
        wait_for(lambda: js("updates") >= 1, 20, "the page's first picture")
        online = lambda: len(driver.find_elements("css selector", "#devices tr.online"))  # noqa: E731

        device(1, "raspberry-pi-4")  # Int8
        wait_for(lambda: online() == 1, 60, "dev1 online on the page")
        # fedbit status on the running job, waiting for the second device (live.json is
        # rewritten at most once a second)
        def status_names_dev1() -> str:
            capsys.readouterr()
            assert fedbit(["status", str(out)]) == 0
            text = capsys.readouterr().out
            return text if "dev1" in text else ""

        status = wait_for(status_names_dev1, 10, "fedbit status naming dev1", step=0.2)
        assert "running" in status and re.search(r"dev1\s.*online.*raspberry-pi-4\s.*int8", status), status
        assert "waiting for devices, 1 of 2 present" in status, status
        metrics = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(metrics)}
        assert fams["fedbit_devices_online"].samples[0].value == 1
        assert fams["fedbit_rounds_completed"].samples[0].value == 0
        for bad, code in (("nosuch", 404), ("api/state?rounds=x", 400)):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(url + bad, timeout=10)
            assert e.value.code == code

        device(2, "jetson-nano")  # Int16, asym-8 uplink
        assert coord.wait(timeout=120) == 0, text("coord", "err")[-3000:]
        for p in procs[1:]:
            assert p.wait(timeout=30) == 0, text(f"dev{procs.index(p)}", "err")[-2000:]
        wait_for(lambda: js("rounds()") == 3, 10, "the third round on the page")
        history = js("history")  # [ms, accuracy points, devices online] at every render
        points = [h[1] for h in history]
        assert max(h[2] for h in history) == 2  # both devices online at once
        assert points == sorted(points) and {1, 2, 3} <= set(points), points  # a point per round
        assert js("accuracyPoints()") == 3
        latencies = js("latencies")
        assert len(latencies) == 3 and max(latencies) < 1.0, latencies  # each round on the page within 1 s
        assert driver.find_element("id", "state").text == "done"
        assert len(driver.find_elements("css selector", "#devices tbody tr")) == 2
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 20_000
        print(f"dashboard screenshot: {shot}")
        logs = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "/events" not in e["message"]]
        assert not logs, logs  # no script error, nothing blocked by the page's CSP
    finally:
        driver.quit()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=10)
    with capsys.disabled():
        print(f"\ndashboard screenshot: {tmp_path / 'dashboard.png'}")

    # the operator's lines: stdout says it once, the text log on stderr does not repeat it
    so, se = text("coord"), text("coord", "err")
    assert re.search(r"device 'dev1' joined \(raspberry-pi-4, int8, uplink int-8\); 1 online", so)
    assert re.search(r"round 1/3: 2 device\(s\) selected after waiting \d+\.\d s for devices", so)
    assert re.search(r"round 1/3: accuracy .* s \(\+ \d+\.\d\d s waiting for devices\)", so)
    assert "joined" not in se and "round 1" not in se, se[-2000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["wait_seconds"] > 0.5 and recs[1]["wait_seconds"] < 0.5
    assert recs[0]["round_seconds"] < recs[0]["wait_seconds"] + recs[0]["round_seconds"]
    # the finished job: status, and the report of a serve folder with its ONNX files
    assert fedbit(["status", str(out)]) == 0
    assert "done (every round completed); 3 of 3 rounds" in capsys.readouterr().out
    assert fedbit(["report", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "`onnx/int8.onnx`" in summary and "`onnx/float32.onnx`" in summary
    assert (out / "accuracy.png").is_file()
