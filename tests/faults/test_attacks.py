"""Attacks on a running coordinator, real processes and a real mosquitto *without* the
generated ACL (a misconfigured broker: anyone may publish anywhere), so that only the
coordinator's own rules stand between the attacker and the model:

- the issue's attack: a client with no device key publishes, the moment each round is
  announced, a negated copy of the model as device ``dev1`` claiming 100,000 samples;
- an enrolled device claiming 100,000 samples (enrolled with 10);
- a hello / presence flood from a compromised device, and under a thousand new ids.

and, on the broker ``fedbit serve`` starts for a job with enrolled devices (loopback, no
``--security``: passwords, the ACL, client id = username, the coordinator on a listener
of its own), an enrolled device's stolen credentials used to connect under dev1's and the
coordinator's client ids, an anonymous client, a device password at the coordinator's
listener, and a device enrolled without ``--max-samples`` claiming 100,000 samples.

Each trial must still end with every round counting each real device once and the exact
model (``scenario.Run.check``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from scenario import DEVICES, Run, report, trials

from coordinator.ops.broker import MosquittoBroker, free_port, resolve_security, start_job_broker
from coordinator.ops.credentials import COORDINATOR_USER, DEFAULT_MAX_SAMPLES, JobSecurity
from edge_client import auth
from edge_client.protocol import (
    Hello,
    Presence,
    RoundAnnouncement,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    topic,
)
from edge_client.runtime import model_to_shared
from edge_client.transport import MqttTransport

pytestmark = pytest.mark.mosquitto


def enrolled_run(d: Path, broker: MosquittoBroker, job: str, max_samples: dict[str, int] | None = None,
                 **kw) -> tuple[Run, dict[str, auth.Credentials]]:
    sec = JobSecurity(d / "security", job)
    creds = {dev: sec.enroll(dev, broker=broker.url, max_samples=(max_samples or {}).get(dev))[0]
             for dev, _, _ in kw.get("devices", DEVICES)}
    run = Run(d, broker.url, job=job, coordinator_args=("--enrolment", str(sec.registry_path)),
              device_args={dev: ["--mac-key", c.mac_key] for dev, c in creds.items()}, **kw)
    return run, creds


class Attacker(threading.Thread):
    """Waits for each round announcement and model, then publishes ``forge(round, model)``
    on ``dev1``'s update topic (what the issue's attacker did)."""

    def __init__(self, url: str, job: str, forge) -> None:
        super().__init__(daemon=True)
        self.t = MqttTransport(url, f"attacker-{job}", subscriptions=[topic(job, "round"), topic(job, "model", "float32")])
        self.job, self.forge, self.sent = job, forge, 0
        self.stop = threading.Event()

    def run(self) -> None:
        self.t.connect(10)
        ann, model = None, None
        while not self.stop.is_set():
            m = self.t.recv(0.1)
            if m is None or not m.payload:
                continue
            msg = decode_message(m.payload)
            ann = msg if isinstance(msg, RoundAnnouncement) else ann
            model = msg if not isinstance(msg, RoundAnnouncement) else model
            if ann is not None and model is not None and model.round_id == ann.round_id:
                self.t.publish(topic(self.job, "update", "dev1"), self.forge(ann, model), timeout=5)
                self.sent += 1
                ann = None

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        self.t.close()


def negated(ann: RoundAnnouncement, model) -> bytes:
    w = model_to_shared(model)
    return encode_message(Update("dev1", ann.round_id, 100_000, 32, "weights",
                                 tuple(float32_tensor(-x) for x in w)))


def test_spoofed_update_on_a_broker_without_acl_is_never_counted(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        run, _ = enrolled_run(d, mosquitto, f"a{trial}")
        attacker = Attacker(mosquitto.url, run.job, negated)
        try:
            # (rounds of >= 0.5 s: the attacker, connecting after the forks on a loaded machine,
            # is in before round 1 ends, so it forges in every round)
            devs = run.all_devices(dev1=0.5, dev2=0.5)
            coord = run.coordinator()
            attacker.start()  # (after the forks)
            run.finish(coord, devs)
            totals = run.check()
        except BaseException:
            report("spoofed update as dev1 (negated model, 100,000 samples), broker without ACL", trial, "FAILED")
            raise
        finally:
            attacker.close()
            run.close()
        # the last round's forgery may land after the coordinator closed its last round and
        # stopped (never read, so never counted); every earlier one was read and refused
        assert attacker.sent >= run.rounds and totals.get("rejected_bad_mac", 0) >= run.rounds - 1
        report("spoofed update as dev1 (negated model, 100,000 samples), broker without ACL", trial,
               "every forgery refused (bad MAC); the real dev1 counted every round; exact model",
               forged_updates_sent=attacker.sent, rejected_bad_mac=totals["rejected_bad_mac"])


def test_enrolled_device_inflating_num_samples_is_clipped(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    """dev2 reports 100,000 samples in its hello and updates; it was enrolled with 10, so
    it weighs 10: the model is exactly the one of a dev2 with 10 samples."""
    devices = [("dev1", 0.01, 30), ("dev2", -0.02, 100_000)]
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        run, _ = enrolled_run(d, mosquitto, f"n{trial}", max_samples={"dev2": 10}, devices=devices)
        try:
            run.finish(run.coordinator(), run.all_devices())
            totals = run.check(samples={"dev2": 10})
        except BaseException:
            report("enrolled device claiming 100,000 samples (enrolled with 10)", trial, "FAILED")
            raise
        finally:
            run.close()
        assert totals.get("clipped_num_samples") == run.rounds
        report("enrolled device claiming 100,000 samples (enrolled with 10)", trial,
               "its weight clipped to 10 every round; exact model", clipped_num_samples=totals["clipped_num_samples"])


def test_hello_and_presence_floods_are_rate_limited(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    """A compromised device (dev1's key) floods 1,000 hellos and 1,000 presences under its
    own id, and 1,000 hellos come under new ids, while the job runs: dev1's are
    rate-limited, the strangers' refused as unenrolled, the registry holds the two real
    devices, every round counts them."""
    fault = "hello/presence flood (2,000 signed as dev1, 1,000 new ids)"
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        run, creds = enrolled_run(d, mosquitto, f"h{trial}")
        flood = MqttTransport(mosquitto.url, f"flood-{trial}")
        key = creds["dev1"].mac_key_bytes
        try:
            devs = run.all_devices()
            coord = run.coordinator()
            flood.connect(10)  # (after the forks)
            hello = auth.sign(encode_message(Hello("dev1", "custom", 32, "torch", "float32", 32, 30, "x")), key)
            online = auth.sign(encode_message(Presence("dev1", True)), key)
            for i in range(1000):
                flood.publish(topic(run.job, "hello", "dev1"), hello, qos=0)
                flood.publish(topic(run.job, "presence", "dev1"), online, qos=0)
                flood.publish(topic(run.job, "hello", f"x{i}"),
                              encode_message(Hello(f"x{i}", "p", 8, "int", "int", 8, 5, "x")), qos=0)
            run.finish(coord, devs)
            totals = run.check()
        except BaseException:
            report(fault, trial, "FAILED")
            raise
        finally:
            flood.close()
            run.close()
        from coordinator.state import RunState

        assert sorted(RunState(run.out).load_devices()) == ["dev1", "dev2"]
        assert totals.get("rejected_rate_limited", 0) > 0 and totals.get("rejected_unenrolled", 0) > 0
        report(fault, trial, "dev1's flood rate-limited, strangers refused; registry = the 2 real devices; "
               "exact model", rejected_rate_limited=totals.get("rejected_rate_limited", 0),
               rejected_unenrolled=totals.get("rejected_unenrolled", 0))


def connect_refused(url: str, client_id: str, username: str | None = None, password: str | None = None) -> str:
    """'' when the broker gives ``client_id`` a session, else why not."""
    t = MqttTransport(url, client_id, username=username, password=password, protocol="5")
    try:
        t.connect(5)
        return ""
    except ConnectionError as exc:
        return str(exc)
    finally:
        t.close()


class Intruder(threading.Thread):
    """dev3 (enrolled, its credentials stolen; no device of its own runs) connects over and
    over under dev1's and the coordinator's client ids and publishes as dev1 while the job
    runs; between tries, an anonymous client and dev3's password at the coordinator's
    listener knock."""

    def __init__(self, device_url: str, coordinator_url: str, job: str, dev3: auth.Credentials) -> None:
        super().__init__(daemon=True)
        self.urls, self.job, self.dev3 = (device_url, coordinator_url), job, dev3
        self.stop = threading.Event()
        self.takeovers = self.anonymous_refused = self.coordinator_listener_refused = 0
        self.failures: list[str] = []

    def run(self) -> None:
        device_url, coordinator_url = self.urls
        victims = ("dev1", COORDINATOR_USER, f"fedbit-coordinator-{self.job}")
        forged = auth.sign(encode_message(Update("dev1", 1, 100_000, 32, "weights", ())), self.dev3.mac_key_bytes)
        while not self.stop.is_set():
            for victim in victims:
                t = MqttTransport(device_url, victim, username="dev3", password=self.dev3.password, protocol="5")
                try:
                    t.connect(5)
                    t.publish(topic(self.job, "update", "dev1"), forged, qos=0)  # (the ACL drops it)
                    self.takeovers += 1
                    self.stop.wait(0.3)
                except ConnectionError as exc:
                    self.failures.append(f"dev3 as {victim}: {exc}")
                finally:
                    t.close()
            why = connect_refused(device_url, "anon")
            self.anonymous_refused += bool(why)
            if not why:
                self.failures.append("an anonymous client got a session")
            why = connect_refused(coordinator_url, "dev3", "dev3", self.dev3.password)
            self.coordinator_listener_refused += bool(why)
            if not why:
                self.failures.append("dev3's password opened the coordinator's listener")

    def close(self) -> None:
        self.stop.set()
        self.join(30)


def test_secured_job_stolen_credentials_anonymous_and_uncapped_samples(mosquitto_bin: str, tmp_path: Path) -> None:
    """The broker `fedbit serve` starts for a loopback job with enrolled devices: dev3's
    credentials never take dev1's or the coordinator's session (both stay connected from
    start to end, no 'coordinator offline' will fires), an anonymous client and a device
    password at the coordinator's listener are refused at connect; dev2, enrolled without
    --max-samples, claims 100,000 samples and weighs the default cap every round."""
    rows = ("enrolled device's credentials used under dev1's and the coordinator's client ids",
            "anonymous client on a loopback job with enrolled devices",
            "a device's password at the coordinator's own listener",
            f"device enrolled without --max-samples claiming 100,000 samples (default cap {DEFAULT_MAX_SAMPLES:,})")
    devices = [("dev1", 0.01, 30), ("dev2", -0.02, 100_000)]
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        job, port = f"s{trial}", free_port()
        sec = JobSecurity(d / "security", job)
        creds = {dev: sec.enroll(dev, broker=f"mqtt://127.0.0.1:{port}")[0] for dev in ("dev1", "dev2", "dev3")}
        files = {dev: auth.write_private(d / f"{dev}.toml", c.to_toml()) for dev, c in creds.items()}
        mode = resolve_security("auto", "127.0.0.1", enrolled=3, tls=False)
        jb = start_job_broker("127.0.0.1", port, security=mode, job_security=sec, workdir=d / "broker")
        run = Run(d, jb.device_url, job=job, devices=devices, coordinator_url=jb.coordinator_url,
                  coordinator_args=("--enrolment", str(sec.registry_path), "--credentials", str(sec.coordinator_path)),
                  device_args={dev: ["--credentials", str(files[dev])] for dev in ("dev1", "dev2")})
        intruder = Intruder(jb.device_url, jb.coordinator_url, job, creds["dev3"])
        try:
            assert mode == "password"  # (the job's devices were enrolled for mqtt://: passwords + ACL)
            devs = run.all_devices()
            coord = run.coordinator()
            intruder.start()  # (after the forks)
            run.finish(coord, devs)
            intruder.close()
            totals = run.check(samples={"dev2": DEFAULT_MAX_SAMPLES})
            assert not intruder.failures, intruder.failures[:3]
            assert intruder.takeovers >= 3 and intruder.anonymous_refused and intruder.coordinator_listener_refused
            assert run.result(coord)["connects"] == 1                     # never pushed off
            assert [run.result(p)["connects"] for p in devs] == [1, 1]
            assert totals.get("clipped_num_samples") == run.rounds
            assert not any(k.startswith("rejected") for k in totals), totals  # the ACL dropped the forgeries
        except BaseException:
            for row in rows:
                report(row, trial, "FAILED")
            raise
        finally:
            intruder.close()
            run.close()
            jb.stop()
        report(rows[0], trial, "its client id is its username: dev1 and the coordinator kept their one "
               "session each; publishing as dev1 dropped by the ACL; exact model", takeover_sessions=intruder.takeovers)
        report(rows[1], trial, "refused at connect (the job has enrolled devices: passwords and ACL on "
               "loopback too); exact model", anonymous_refused=intruder.anonymous_refused)
        report(rows[2], trial, "refused at connect (its password file holds the coordinator alone); exact model",
               coordinator_listener_refused=intruder.coordinator_listener_refused)
        report(rows[3], trial, "its weight clipped to the default cap every round; exact model",
               clipped_num_samples=totals["clipped_num_samples"])
