"""A Raspberry Pi's setup commands (issue 15): ``fedbit-edge doctor``, ``measure-link``,
``run --auto-codec`` and ``install-service``, as real subprocesses against a real
mosquitto; the codec choice and the checks as functions."""

from __future__ import annotations

import json
import os
import platform
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.ops.broker import MosquittoBroker
from edge_client.doctor import check_clock, check_ram
from edge_client.link import LinkMeasurement, choose_codec
from hw_profiles import load_profile

BIN = Path(sys.executable).parent
DIGITS_PARAMS = 13_584


def edge(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "fedbit-edge"), *args], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else dict(os.environ, **env))


@pytest.mark.parametrize("profile", ["desktop", "raspberry-pi-4", "raspberry-pi-zero-2w"])
def test_slower_links_get_fewer_bits_and_fast_links_keep_the_profile_s_uplink(profile: str) -> None:
    p = load_profile(profile)
    bits = []
    for kbps in (1e6, 1e4, 500, 100, 30, 1):
        c = choose_codec(p, DIGITS_PARAMS, LinkMeasurement(kbps, 20.0, 0), budget_s=2.0)
        bits.append(c.bits)
        if kbps == 1e6:
            own = 32 if p.codec == "float32" else (max(p.compute_bits, 8) if p.codec == "int" else p.codec_bits)
            assert (c.bits, "superior") == (own, c.reason.split()[0])
    assert bits == sorted(bits, reverse=True) and bits[-1] == 2  # ternary when nothing fits
    # 30 kbit/s: a float32 update (435 kbit) takes 14.5 s; 2-bit ternary (~35 kbit) fits in 2 s? no: 1.2 s + latency
    slow = choose_codec(p, DIGITS_PARAMS, LinkMeasurement(30, 20.0, 0), budget_s=2.0)
    assert slow.codec == "ternary" and slow.upload_s <= 2.0


def test_clock_and_memory_checks(tmp_path: Path) -> None:
    assert not check_clock(0.0).ok and "NTP" in check_clock(0.0).detail
    assert check_clock().ok
    mem = tmp_path / "meminfo"
    mem.write_text("MemTotal: 512000 kB\nMemAvailable:  150000 kB\n")
    low = check_ram(load_profile("raspberry-pi-zero-2w"), str(mem))
    assert not low.ok and "146 MB available of the profile's 512 MB" in low.detail
    mem.write_text("MemAvailable:  400000 kB\n")
    assert check_ram(load_profile("raspberry-pi-zero-2w"), str(mem)).ok


@pytest.mark.mosquitto
def test_doctor_measure_link_and_auto_codec_against_a_real_broker(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    ok = edge("doctor", "--profile", "raspberry-pi-4", "--broker", mosquitto.url, "--id", "pi1")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    for name in ("python", "numba", "memory", "clock", "broker", "uplink"):
        assert any(ln.startswith(f"PASS  {name}:") for ln in lines), ok.stdout
    # the profile's image is a 64-bit ARM one: elsewhere a warning, not a failure
    image = "PASS  image:" if platform.machine() == "aarch64" else "WARN  image:"
    assert any(ln.startswith(image) for ln in lines), ok.stdout
    assert lines[-1] == "doctor: 7 of 7 checks passed" + ("" if image[0] == "P" else "; warnings: image")

    bad = edge("doctor", "--profile", "raspberry-pi-4", "--broker", "mqtt://127.0.0.1:1", "--id", "pi1",
               "--timeout", "2", "--ca", str(tmp_path / "missing-ca.pem"))
    assert bad.returncode == 1
    assert any(ln.startswith("FAIL  broker:") for ln in bad.stdout.splitlines()), bad.stdout
    assert f"FAIL  tls files: cannot read --ca {tmp_path / 'missing-ca.pem'}" in bad.stdout

    link = edge("measure-link", "--profile", "raspberry-pi-zero-2w", "--broker", mosquitto.url, "--id", "pi1")
    assert link.returncode == 0, link.stderr
    rep = json.loads(link.stdout)
    assert rep["throughput_kbps"] > 1000 and rep["latency_ms"] > 0
    assert (rep["codec"], rep["codec_bits"]) == ("int", 8)  # loopback: the profile's own 8-bit grid

    run = edge("run", "--auto-codec", "--profile", "raspberry-pi-5", "--broker", mosquitto.url, "--id", "pi5",
               "--data", "digits:1/8", "--workdir", str(tmp_path / "pi5"), "--max-seconds", "2")
    assert run.returncode == 0, run.stderr
    assert "uplink kmeans-4 (superior" in run.stderr      # Pi 5's own K-means-4 fits on loopback
    assert "uplink kmeans-4" in run.stdout


def test_install_service_writes_a_unit_systemd_accepts(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    dry = edge("install-service", "--profile", "raspberry-pi-4", "--broker", "mqtt://coord.lan:1883", "--id", "pi7",
               "--data", "/data/local", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    for needle in ("Restart=on-failure", f"WorkingDirectory={tmp_path}/state/fedbit/pi7",
                   f"EnvironmentFile={tmp_path}/state/fedbit/pi7/service.env", "warmup --profile raspberry-pi-4",
                   "run --profile raspberry-pi-4 --data /data/local", "NUMBA_CACHE_DIR="):
        assert needle in dry.stdout, needle
    assert not (tmp_path / "state").exists()  # a dry run writes nothing

    units = tmp_path / "units"
    out = edge("install-service", "--profile", "raspberry-pi-4", "--broker", "mqtt://coord.lan:1883", "--id", "pi7",
               "--data", "/data/local", "--dir", str(units), env=env)
    assert out.returncode == 0, out.stderr
    assert "systemctl enable --now fedbit-edge" in out.stdout
    env_file = tmp_path / "state" / "fedbit" / "pi7" / "service.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    unit = units / "fedbit-edge.service"
    if shutil.which("systemd-analyze") is None:
        assert os.environ.get("CI") != "true", "systemd-analyze is missing under CI"
        return
    v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    errors = [ln for ln in (v.stdout + v.stderr).splitlines() if str(unit) in ln or "fedbit-edge.service" in ln]
    assert not errors, errors

    missing = edge("install-service", "--profile", "raspberry-pi-4", "--data", "/d", "--dry-run", env=env)
    assert missing.returncode == 1 and "--broker and --id, or --credentials FILE" in missing.stderr
