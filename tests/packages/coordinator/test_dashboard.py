"""The job's live picture (FleetMonitor, live.json, ``fedbit status``'s view) and the
dashboard server on real sockets: pages, server-sent events, Prometheus metrics, bad
requests (4xx, the server goes on), and beyond loopback HTTPS with the job CA and a
password. The dashboard in a browser during a real run: test_dashboard_browser.py."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import ssl
import stat
import threading
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.job import load_job
from coordinator.ops.dashboard.access import Access, dashboard_access, parse_address
from coordinator.ops.dashboard.monitor import FleetMonitor, LiveFile, fan_out
from coordinator.ops.dashboard.runview import run_view
from edge_client.errors import ConfigError

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from coordinator.ops.dashboard.web import Dashboard  # noqa: E402


def hello(dev: str, bits: int = 8, trainer: str = "int", codec: str = "int-8") -> dict:
    return {"device": dev, "change": "joined", "online": 1, "profile": "raspberry-pi-4", "compute_bits": bits,
            "trainer": trainer, "codec": codec, "num_samples": 100}


def round_end(r: int, acc: float, *, counts: dict | None = None) -> dict:
    return {"round": r, "time": time.time(), "accuracy": acc, "loss": 1.0,
            "groups": {"float32": {"accuracy": acc, "loss": 1.0}, "int8": {"accuracy": float("nan"), "loss": None}},
            "selected": 2, "accepted": 2, "stragglers": 0, "round_seconds": 1.5, "wait_seconds": 0.25,
            "uplink_bytes": {"int-8": 1000, "float32-32": 4000}, "counts": counts or {}}


def feed_round(m: FleetMonitor, r: int, acc: float) -> None:
    m("round_start", {"round": r, "selected": ["a", "b"], "resumed": False, "replayed": 0, "deadline_s": 60.0,
                      "wait_seconds": 0.25})
    for i, dev in enumerate(("a", "b")):
        m("update", {"round": r, "device": dev, "accepted": i + 1, "selected": 2, "bytes": 1000 if dev == "a" else 4000,
                     "codec": "int-8" if dev == "a" else "float32-32", "notes": ["clipped_num_samples"] * (dev == "a")})
    m("round_end", round_end(r, acc, counts={"rejected_bad_mac": 1}))


# --------------------------------------------------------------------------- the picture


def test_the_monitor_follows_devices_rounds_and_refusals() -> None:
    m = FleetMonitor({"job": "farm"}, rounds=3, title="job farm")
    m("device", hello("a"))
    m("device", hello("b", 32, "torch", "float32-32"))
    m("waiting", {"present": 2, "need": 2})
    feed_round(m, 1, 0.5)
    m("reject", {"round": 2, "device": "a", "reason": "bad_mac", "kind": "update", "detail": "x" * 500,
                 "dropped": False})
    m("reject", {"round": 2, "device": "ghost", "reason": "unenrolled", "kind": "hello", "detail": "", "dropped": False})
    m("device", {"device": "b", "change": "left", "online": 1})
    snap = m.snapshot()
    devs = {d["device_id"]: d for d in snap["devices"]}
    assert set(devs) == {"a", "b", "ghost"}  # a refused stranger gets a row (at most STRANGERS of them)
    assert not devs["ghost"]["registered"] and devs["ghost"]["refusals"] == {"unenrolled": 1}
    assert (snap["registered"], snap["devices_total"]) == (2, 3)
    assert devs["a"]["online"] and not devs["b"]["online"] and snap["online"] == 1
    assert devs["a"]["variant"] == "int8" and devs["b"]["variant"] == "float32"
    assert (devs["a"]["last_round"], devs["a"]["last_bytes"], devs["a"]["last_codec"]) == (1, 1000, "int-8")
    assert devs["a"]["refusals"] == {"bad_mac": 1} and devs["a"]["notes"] == {"clipped_num_samples": 1}
    assert [r["round"] for r in snap["rounds"]] == [1]
    assert snap["rounds"][0]["groups"] == {"float32": 0.5, "int8": None}  # NaN is not JSON
    json.dumps(snap, allow_nan=False)
    tot = snap["totals"]
    # round 1's exact counts plus what the open round logged so far
    assert tot["refused"] == {"rejected_bad_mac": 2, "rejected_unenrolled": 1}
    assert tot["uplink_bytes"] == {"float32-32": 4000, "int-8": 1000} and tot["accepted"] == 2
    assert len(snap["recent_refusals"]) == 2 and len(snap["recent_refusals"][0]["detail"]) == 200
    feed_round(m, 2, 0.6)
    assert m.totals()["refused"] == {"rejected_bad_mac": 2}  # the record replaced the live count
    assert m.snapshot(rounds_after=1)["rounds"][0]["round"] == 2
    calls: list[str] = []
    fan_out(None, lambda e, f: calls.append(e), lambda e, f: calls.append(e + "!"))("x", {})
    assert calls == ["x", "x!"]
    m("quarantine", {"device": "a", "change": "quarantined", "round": 3, "reasons": ["round 3: update norm 40x"]})
    snap = m.snapshot()
    assert snap["quarantined"] == ["a"] and snap["devices"][0]["quarantined"] == ["round 3: update norm 40x"]
    m("quarantine", {"device": "a", "change": "released", "round": 4, "reasons": []})
    assert m.snapshot()["quarantined"] == [] and not m.snapshot()["devices"][0]["quarantined"]
    m("alert", {"round": 5, "text": "rounds 4-5 all collapsed"})
    assert m.snapshot()["alerts"][0]["text"] == "rounds 4-5 all collapsed" and m.snapshot()["alerts_total"] == 1


def test_a_large_fleet_is_counted_whole_and_listed_in_part(monkeypatch) -> None:
    import coordinator.ops.dashboard.monitor as monitor

    monkeypatch.setattr(monitor, "DEVICE_ROWS", 5)
    monkeypatch.setattr(monitor, "STRANGERS", 3)
    m = FleetMonitor({"job": "big"}, rounds=1)
    for i in range(12):
        m("device", hello(f"d{i:02d}"))
    m("device", {"device": "d03", "change": "left", "online": 11})
    for i in range(10):  # a flood of refused ids: three rows, the rest only counted
        m("reject", {"device": f"x{i}", "reason": "bad_mac", "kind": "hello", "detail": "", "dropped": False})
    snap = m.snapshot()
    assert [d["device_id"] for d in snap["devices"]] == ["d00", "d01", "d02", "d03", "d04"]
    assert (snap["devices_total"], snap["registered"], snap["online"]) == (15, 12, 11)
    assert snap["totals"]["refused"] == {"rejected_bad_mac": 10}
    m("device", hello("x0"))  # a stranger whose hello is accepted at last
    assert (m.snapshot()["registered"], m.snapshot()["devices_total"]) == (13, 15)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["hello", "hello8", "on", "off"])), max_size=60))
def test_the_registry_reports_joins_and_leaves_and_counts_present_devices(steps) -> None:
    """``DeviceRegistry.apply`` says ``joined``/``left`` exactly when a device with a
    hello changes presence (or its hello), and its O(1) count is a recount's."""
    from coordinator.devices import DeviceRegistry
    from edge_client.protocol import Hello, Presence

    reg = DeviceRegistry()
    for i, what in steps:
        dev = f"d{i}"
        before = set(reg.present()), reg.hellos.get(dev)
        m = (Hello(dev, "p", 8 if what == "hello8" else 32, "int", "int", 8, 10, "1") if what.startswith("hello")
             else Presence(dev, what == "on"))
        change = reg.apply(m)
        after = set(reg.present())
        if dev in after - before[0] or (dev in after and isinstance(m, Hello) and before[1] != m):
            assert change == "joined"
        elif dev in before[0] - after:
            assert change == "left"
        else:
            assert change is None
        assert reg.n_present == len(after)


def test_live_file_and_the_status_view(tmp_path: Path) -> None:
    m = FleetMonitor({"job": "farm", "model": "mlp", "strategy": "fedavg"}, rounds=2, title="job farm")
    live = LiveFile(m, tmp_path, interval=0.05)
    m("device", hello("a"))
    feed_round(m, 1, 0.5)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(round_end(1, 0.5)) + "\n")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        v = run_view(tmp_path)
        if v["devices"] and v["totals"].get("rounds") == 1:
            break
        time.sleep(0.02)
    assert v["state"] == "running" and str(os.getpid()) in v["why"]
    assert v["devices"][0]["device_id"] == "a" and v["current"]["phase"] == "closed"
    live.close()
    m.close("stopped")
    live.write()
    assert run_view(tmp_path)["state"] == "stopped"
    # a coordinator that died without a word: its pid is gone
    data = json.loads((tmp_path / "live.json").read_text()) | {"state": "running", "pid": 2 ** 22 + 12345}
    (tmp_path / "live.json").write_text(json.dumps(data))
    v = run_view(tmp_path)
    assert v["state"] == "stopped" and "gone" in v["why"]
    # an emulated run folder keeps its run in out/
    (tmp_path / "em" / "out").mkdir(parents=True)
    (tmp_path / "em" / "out" / "metrics.jsonl").write_text(json.dumps(round_end(1, 0.5)) + "\n")
    assert run_view(tmp_path / "em")["rounds"][0]["round"] == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a run folder"):
        run_view(tmp_path / "empty")
    with pytest.raises(ConfigError, match="no such run folder"):
        run_view(tmp_path / "nope")
    assert not (tmp_path / "empty" / "inbox").exists()  # reading creates nothing


def test_dashboard_addresses_and_job_keys(tmp_path: Path) -> None:
    assert parse_address("8080") == ("127.0.0.1", 8080)
    assert parse_address("0") == ("127.0.0.1", 0)
    assert parse_address("0.0.0.0:8443") == ("0.0.0.0", 8443)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    for bad in ("", "x", "host:", ":99999", "a b:80", "8080:"):
        with pytest.raises(ConfigError, match="--dashboard"):
            parse_address(bad)
    job = tmp_path / "job.toml"
    job.write_text(f'out = "{tmp_path}/run"\n[dashboard]\nlisten = 8080\npassword_file = "pw"\n')
    j = load_job(job)
    assert (j.dashboard.listen, j.dashboard.password_file) == ("8080", "pw")
    assert j.table["dashboard"]["listen"] == 8080 and j.table["job"] == "default"
    with pytest.raises(ConfigError, match="dashboard.listen"):
        load_job(job, {"dashboard.listen": "nope:nope"})
    with pytest.raises(ConfigError, match="dashboard.nosuch"):
        load_job(job, {"dashboard.nosuch": 1})
    from coordinator.cli import build_parser
    from coordinator.job import job_from_args

    args = build_parser().parse_args(["serve", "--config", str(job), "--dashboard", "0.0.0.0:9443"])
    assert job_from_args(args).dashboard.listen == "0.0.0.0:9443"


# --------------------------------------------------------------------------- the server


@pytest.fixture
def served():
    m = FleetMonitor({"job": "farm", "model": "mlp"}, rounds=3, title="job farm")
    d = Dashboard(m, Access("127.0.0.1", 0), throttle_s=0.2)
    url = d.start()
    try:
        yield m, d, url
    finally:
        d.stop()


def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def get(url: str, **kw) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers=kw.pop("headers", {}), method=kw.pop("method", "GET"))
    try:
        with urllib.request.urlopen(req, timeout=10, **kw) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def raw(url: str, data: bytes) -> bytes:
    host, port = url.split("//")[1].strip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
            if b"\r\n\r\n" in out:
                break
    return out


def test_pages_state_and_metrics(served) -> None:
    m, d, url = served
    feed_round(m, 1, 0.42)
    code, body, headers = get(url)
    assert code == 200 and b"uPlot.iife.min.js" in body and "default-src 'self'" in headers["Content-Security-Policy"]
    for path in ("static/uplot/uPlot.iife.min.js", "static/uplot/LICENSE", "static/dashboard.js"):
        assert get(url + path)[0] == 200, path
    code, body, _ = get(url + "api/state?rounds=0")
    state = json.loads(body)
    assert code == 200 and state["rounds"] == [] and state["rounds_done"] == 1 and state["title"] == "job farm"
    assert json.loads(get(url + "api/state")[1])["rounds"][0]["accuracy"] == 0.42
    code, body, headers = get(url + "metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    sample = lambda name, **labels: next(s.value for s in fams[name].samples  # noqa: E731
                                         if all(s.labels.get(k) == v for k, v in labels.items()))
    assert fams["fedbit_rounds_completed"].type == "counter" and sample("fedbit_rounds_completed") == 1
    assert sample("fedbit_accuracy_ratio", group="float32") == 0.42
    assert not [s for s in fams["fedbit_accuracy_ratio"].samples if s.labels["group"] == "int8"]  # NaN: none
    assert sample("fedbit_uplink_bytes", codec="float32-32") == 4000
    assert sample("fedbit_updates_rejected", reason="bad_mac") == 1
    assert sample("fedbit_updates_accepted") == 2
    assert fams["fedbit_round_duration_seconds"].type == "histogram"
    assert [s.value for s in fams["fedbit_round_duration_seconds"].samples if s.name.endswith("_count")] == [1]
    assert sample("fedbit_device_wait_seconds") == 0.25
    assert sample("fedbit_devices_quarantined") == 0 and sample("fedbit_alerts") == 0


def test_bad_requests_are_4xx_and_the_server_goes_on(served) -> None:
    m, d, url = served
    assert get(url + "nosuch")[0] == 404
    assert get(url, method="POST")[0] == 405
    assert get(url + "api/state?rounds=-1")[0] == 400
    assert get(url + "api/state?rounds=" + "9" * 40)[0] == 400
    assert get(url, headers={"Host": "evil.example:80"})[0] == 421  # DNS rebinding
    port = url.rstrip("/").rsplit(":", 1)[1]
    for host in ("127.attacker.example", "127.0.0.1.attacker.example", "localhost.attacker.example", "[::1"):
        assert get(url, headers={"Host": f"{host}:{port}"})[0] == 421, host
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "[::1]"):
        assert get(url, headers={"Host": f"{host}:{port}"})[0] == 200, host
    assert get(url + "static/%2e%2e/web.py")[0] in (403, 404)
    assert get(url + "static/../../job.py")[0] in (403, 404)
    status = lambda data: re.match(rb"HTTP/1\.[01] (\d+)", raw(url, data))  # noqa: E731
    assert status(b"GARBAGE\r\n\r\n")[1] == b"400"
    assert status(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")[1] in (b"400", b"431")
    assert status(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64) + b"\r\n\r\n")[1] == b"400"
    assert get(url + "api/state")[0] == 200  # still serving


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=60))
def test_any_path_is_answered_without_a_server_error(served, path: str) -> None:
    m, d, url = served
    quoted = urllib.request.quote(path, safe="/?=&%")
    code = get(url + quoted.lstrip("/"))[0]
    assert code < 500, (path, code)


def test_events_reach_a_client_within_a_second(served) -> None:
    m, d, url = served
    host, port = url.split("//")[1].strip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/events")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    got: list[tuple[float, str, dict]] = []

    def read() -> None:
        kind = ""
        for line in resp:
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                got.append((time.time(), kind, json.loads(line[6:])))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    wait_until(lambda: got, "the first message")
    assert got[0][1] == "snapshot" and got[0][2]["rounds"] == []
    for r in (1, 2, 3):
        feed_round(m, r, 0.1 * r)
        wait_until(lambda r=r: any(r in [x["round"] for x in g["rounds"]] for _, _, g in got), f"round {r}")
    # one message per round (rounds are not held back by the throttle), each within a second
    sent = [(t, g["rounds"]) for t, k, g in got if k == "update" and g["rounds"]]
    assert [[x["round"] for x in rs] for _, rs in sent] == [[1], [2], [3]]
    assert all(t - rs[0]["closed_at"] < 1.0 for t, rs in sent), sent
    m.new_run({"job": "next"}, 1, "next")  # a new run (emulate's sweeps): a new snapshot
    wait_until(lambda: got[-1][1] == "snapshot", "the new run's snapshot")
    assert got[-1][2]["title"] == "next" and got[-1][2]["rounds"] == []
    d.stop()  # streams end with the server
    t.join(5)
    assert not t.is_alive()


def test_beyond_loopback_it_takes_tls_and_the_password(openssl_bin: str, tmp_path: Path) -> None:
    access = dashboard_access("0.0.0.0:0", security_dir=tmp_path / "security", job="farm")
    assert access.scheme == "https" and access.password_file == tmp_path / "security" / "dashboard.password"
    assert stat.S_IMODE(access.password_file.stat().st_mode) == 0o600
    password = access.password_file.read_text().strip()
    m = FleetMonitor({"job": "farm"}, rounds=1)
    d = Dashboard(m, access)
    url = d.start().replace("0.0.0.0", "127.0.0.1")
    try:
        assert url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(tmp_path / "security" / "ca.crt"))
        auth = lambda u, p: {"Authorization": "Basic " + b64encode(f"{u}:{p}".encode()).decode()}  # noqa: E731
        assert get(url, context=ctx)[0] == 401
        assert get(url, context=ctx, headers=auth("fedbit", "wrong"))[0] == 401
        assert get(url, context=ctx, headers={"Authorization": "Basic !!!"})[0] == 401
        code, _, headers = get(url + "metrics", context=ctx, headers=auth("fedbit", password))
        assert code == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            get(url.replace("https://", "http://"))  # no plain HTTP
        with pytest.raises(urllib.error.URLError):
            get(url, context=ssl.create_default_context())  # the job CA signed it, nobody else
    finally:
        d.stop()
    # the same files are used again (no new password on restart)
    again = dashboard_access("0.0.0.0:0", security_dir=tmp_path / "security", job="farm")
    assert again.password_sha256 == access.password_sha256 and again.cert == access.cert
