"""The admission rules of the coordinator's ingest: enrolment and the device MAC (checked
before any parsing), the ``num_samples`` bound, the per-device hello/presence rate, the
registry's size; and the collector's counting of them."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from coordinator.devices import DeviceRegistry
from coordinator.ingest import Ingest, OpenRound, Rejected
from coordinator.ops.admission import AdmissionConfig, RateLimiter
from coordinator.ops.credentials import JobSecurity
from edge_client import auth
from edge_client.errors import ConfigError
from edge_client.protocol import Hello, Limits, Presence, Update, encode_message, float32_tensor
from firmware_models import get_spec

SHAPES = [tuple(s) for s in get_spec("mlp").param_shapes()]
JOB = "adm"


def update(dev: str = "a", r: int = 1, n: int = 5) -> bytes:
    return encode_message(Update(dev, r, n, 32, "weights",
                                 tuple(float32_tensor(np.zeros(s, np.float32)) for s in SHAPES)))


def hello(dev: str = "a", n: int = 50) -> bytes:
    return encode_message(Hello(dev, "desktop", 32, "torch", "float32", 32, n, "t"))


def reason(fn) -> str:
    with pytest.raises(Rejected) as e:
        fn()
    return e.value.metric


@pytest.fixture
def enrolled(tmp_path: Path) -> tuple[Ingest, dict[str, bytes]]:
    sec = JobSecurity(tmp_path / "security", JOB)
    keys = {d: sec.enroll(d, broker="mqtt://127.0.0.1:1883", max_samples=ms)[0].mac_key_bytes
            for d, ms in (("a", 20), ("b", 0))}
    ing = Ingest("mlp", SHAPES, Limits(), AdmissionConfig(enrolment=str(sec.registry_path)), JOB)
    return ing, keys


def test_enrolled_devices_only_and_their_mac_before_parsing(enrolled) -> None:
    ing, keys = enrolled
    rnd = OpenRound(1, frozenset({"a", "b", "c"}))
    good = auth.sign(update("a"), keys["a"])
    assert ing.update("a", good, rnd, 0).device_id == "a"
    assert reason(lambda: ing.update("a", update("a"), rnd, 0)) == "rejected_bad_mac"           # unsigned
    assert reason(lambda: ing.update("a", auth.sign(update("a"), keys["b"]), rnd, 0)) == "rejected_bad_mac"
    assert reason(lambda: ing.update("b", good, rnd, 0)) == "rejected_bad_mac"                  # replayed elsewhere
    assert reason(lambda: ing.update("c", auth.sign(update("c"), keys["a"]), rnd, 0)) == "rejected_unenrolled"
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 1
    assert reason(lambda: ing.update("a", bytes(flipped), rnd, 0)) == "rejected_bad_mac"
    # a garbage payload with a valid MAC reaches the parser, one without never does
    garbage = auth.sign(b"\x81\xa1v\xc1", keys["a"])
    assert reason(lambda: ing.update("a", garbage, rnd, 0)) == "rejected_malformed"
    assert reason(lambda: ing.device("hello", "a", hello("a"))) == "rejected_bad_mac"
    assert ing.device("hello", "a", auth.sign(hello("a"), keys["a"])).num_samples == 50
    assert reason(lambda: ing.device("presence", "z", encode_message(Presence("z", True)))) == "rejected_unenrolled"


def test_num_samples_is_bounded_by_enrolment_hello_and_the_job_cap(enrolled) -> None:
    ing, keys = enrolled
    reg = DeviceRegistry()
    reg.apply(Hello("b", "desktop", 32, "torch", "float32", 32, 70, "t"))
    rnd = OpenRound(1, frozenset({"a", "b"}))

    def n_of(dev: str, n: int) -> int:
        ing.notes.clear()
        return ing.update(dev, auth.sign(update(dev, n=n), keys[dev]), OpenRound(1, rnd.selected), 0, reg).num_samples

    assert n_of("a", 100_000) == 20 and ing.notes["clipped_num_samples"] == 1    # enrolled with 20
    assert n_of("a", 7) == 7 and not ing.notes
    assert n_of("b", 100_000) == 70                                              # its hello said 70
    ing.admission.max_samples = 50
    assert n_of("b", 100_000) == 50 and ing.sample_bound("b", reg) == (50, "the job's max_samples")
    ing.admission.samples_policy = "reject"
    assert reason(lambda: n_of("b", 51)) == "rejected_too_many_samples"
    assert ing.sample_bound("nobody") == (50, "the job's max_samples")
    ing.admission.max_samples = 0
    assert ing.sample_bound("nobody") == (0, "")


def test_hello_and_presence_are_rate_limited_per_device() -> None:
    ing = Ingest("mlp", SHAPES, Limits(), AdmissionConfig(hello_rate=2.0, hello_burst=5))
    t0 = 1000.0
    for i in range(5):
        assert ing.device("hello", "a", hello("a"), now=t0 + 0.001 * i) is not None
    assert reason(lambda: ing.device("presence", "a", encode_message(Presence("a", True)), now=t0 + 0.01)) \
        == "rejected_rate_limited"
    assert ing.device("hello", "b", hello("b"), now=t0 + 0.01) is not None           # per device
    assert ing.device("hello", "a", hello("a"), now=t0 + 0.6) is not None            # refilled at 2/s
    with pytest.raises(Rejected) as e:
        ing.device("hello", "a", hello("a"), now=t0 + 0.61)
    assert e.value.quiet                                                             # not a log flood


def test_the_rate_limiter_keeps_its_memory_bounded() -> None:
    rl = RateLimiter(1.0, 3, max_keys=100)
    for i in range(10_000):
        rl.allow(f"d{i}", now=float(i) * 1e-4)
    assert len(rl) <= 100
    assert rl.allow("d9999", now=1.0) and rl.allow("d9999", now=1.0)


def test_the_registry_stops_at_max_registered() -> None:
    ing = Ingest("mlp", SHAPES, Limits(), AdmissionConfig(max_registered=3))
    reg = DeviceRegistry()
    for d in ("a", "b", "c"):
        reg.apply(ing.device("hello", d, hello(d), reg))
    assert reason(lambda: ing.device("hello", "d", hello("d"), reg)) == "rejected_registry_full"
    assert ing.device("hello", "a", hello("a", 60), reg).num_samples == 60           # known ones update
    assert ing.device("presence", "b", encode_message(Presence("b", False)), reg) is not None
    assert sorted(reg.hellos) == ["a", "b", "c"]


def test_admission_settings_are_validated() -> None:
    for bad in ({"max_samples": -1}, {"samples_policy": "maybe"}, {"max_registered": 0},
                {"hello_rate": 0}, {"hello_burst": 0}, {"max_samples": True}):
        with pytest.raises(ConfigError):
            AdmissionConfig(**bad).validate()


def test_the_collector_counts_clips_and_keeps_floods_out_of_the_log(tmp_path: Path, caplog) -> None:
    from coordinator.config import ServerConfig
    from coordinator.fleet import Inbound, InProcessFleet
    from coordinator.server import Coordinator
    from coordinator.state import RunState
    from coordinator.strategies import build_strategy
    from edge_client.intnn import init_shared
    from edge_client.transport import Received

    fleet = InProcessFleet(JOB)
    fleet.start()
    from coordinator.defense.config import DefenseConfig

    # hold=1: the poisoning defense folds the first update at once (its sums are what is read)
    cfg = ServerConfig(job=JOB, model="mlp", rounds=1, admission=AdmissionConfig(max_samples=9),
                       defense=DefenseConfig(hold=1))
    co = Coordinator(cfg, fleet, build_strategy("fedavg"), RunState(tmp_path / "run"), evaluator=None,
                     init_weights=init_shared(get_spec("mlp"), 0))
    col = co.collector

    def msg(kind: str, dev: str, p: bytes) -> Inbound:
        return Inbound(kind, dev, p, time.monotonic(), f"fedbit/{JOB}/{kind}/{dev}", Received("t", p, 1))

    try:
        co.open_round(1, ["a"])
        with caplog.at_level(logging.DEBUG, logger="fedbit"):
            col.handle_batch([msg("update", "a", update("a", n=1000))])
            col.handle_batch([msg("update", "a", b"\xc1") for _ in range(100)])
        assert col.counts["clipped_num_samples"] == 1 and co.strategy._sums.total[32] == 9.0
        assert col.counts["rejected_malformed"] == 100
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == col.log_per_reason
    finally:
        fleet.close()
