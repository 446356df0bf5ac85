"""Fault injection with real processes and a real mosquitto
(docs/architecture.md#failure-semantics): the coordinator killed with -9 before and after
an ack, during aggregation and during its checkpoint write; the broker restarted mid-round with and without
persistence; a device killed right after publishing; QoS 1 redelivery of an update the
coordinator already counted; a damaged or truncated checkpoint and inbox record; the
buffered coordinator killed mid-buffer.

Each trial must end with the run complete, every round counting every device exactly
once, and the exact model (``scenario.Run.check``); a damaged file must be reported by
name. ``make faults`` runs every fault ``FEDBIT_FAULT_TRIALS`` times at other kill points
and prints the table of outcomes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for
from scenario import DEVICES, Run, report, trials

from coordinator.ops.broker import MosquittoBroker
from coordinator.state import RunState
from edge_client.intnn import init_shared
from edge_client.protocol import decode_message
from firmware_models import get_spec

pytestmark = pytest.mark.mosquitto
R = 3  # rounds per trial
UPDATES = R * len(DEVICES)


def each_trial(tmp_path: Path, broker: MosquittoBroker, fault: str, body, rounds: int = R) -> None:
    """Run ``body(run, trial)`` once per trial (fresh job, folder and processes each)."""
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        run = Run(d, broker.url, job=f"f{trial}", rounds=rounds)
        try:
            body(run, trial)
            totals = run.check()
        except BaseException:
            report(fault, trial, "FAILED")
            raise
        finally:
            run.close()
        report(fault, trial, "run completed; every round counted each device once; exact model",
               copies_dropped=totals.get("dropped_duplicate", 0) + totals.get("dropped_late", 0),
               damaged_records_reported=totals.get("inbox_damaged", 0))


def kill_then_resume(run: Run, fault: str) -> None:
    devs = run.all_devices()
    run.killed(run.coordinator(fault))
    run.finish(run.coordinator(resume=True), devs)


@pytest.mark.parametrize("point", ["before_ack", "after_ack"])
def test_coordinator_killed_around_an_ack(mosquitto: MosquittoBroker, tmp_path: Path, point: str) -> None:
    """Killed with an update persisted but not acked (the broker redelivers it: QoS 1
    redelivery of an update already counted, dropped as a duplicate), or just after the
    ack (the resumed coordinator replays it from the inbox)."""

    def body(run: Run, trial: int) -> None:
        k = 1 + (2 + trial) % UPDATES  # the 3rd update first: round 2's first
        kill_then_resume(run, f"{point}:{k}")
        if point == "before_ack" and (k - 1) // len(DEVICES) + 1 < R:
            # (in the last round the run may end before the broker redelivers it: then it
            # stays in the broker's session, counted once all the same)
            lines = RunState(run.out).read_metrics()
            dropped = sum(m["counts"].get("dropped_duplicate", 0) + m["counts"].get("dropped_late", 0)
                          for m in lines)
            assert dropped >= 1  # the redelivered copy came back and was not counted again

    each_trial(tmp_path, mosquitto, f"coordinator kill -9 {point.replace('_', ' ')}", body)


@pytest.mark.parametrize("point", ["aggregate", "checkpoint"])
def test_coordinator_killed_while_aggregating_or_checkpointing(mosquitto: MosquittoBroker, tmp_path: Path,
                                                                point: str) -> None:
    """Killed inside ``finish()`` or with half of the checkpoint in its temporary file:
    the round is resumed from its plan and inbox (the torn file is never read)."""

    def body(run: Run, trial: int) -> None:
        kill_then_resume(run, f"{point}:{1 + (1 + trial) % R}")

    each_trial(tmp_path, mosquitto, f"coordinator kill -9 during {'aggregation' if point == 'aggregate' else 'the checkpoint write'}", body)


@pytest.mark.parametrize("persistence", [True, False], ids=["persistent", "volatile"])
def test_broker_restart_mid_round(mosquitto_bin: str, tmp_path: Path, persistence: bool) -> None:
    """mosquitto killed with -9 and restarted on its port while a round is open. Without
    persistence it comes back with no sessions and no retained messages: the coordinator
    publishes the round again on reconnect, devices re-send what the lost broker had."""
    broker = MosquittoBroker(binary=mosquitto_bin, workdir=tmp_path / "mosq", persistence=persistence).start()
    try:
        def body(run: Run, trial: int) -> None:
            r = 1 + (1 + trial) % run.rounds
            devs = [run.device("dev1"), run.device("dev2", delay=0.8)]
            coord = run.coordinator()
            wait_for(lambda: "dev1" in dict(RunState(run.out).inbox_items(r)), 60, f"dev1's round {r} update")
            broker.kill()
            broker.start()
            run.finish(coord, devs)
            if not persistence:
                out = json.loads(coord.out.read_text().splitlines()[-1])
                assert out["republished"] >= 1

        each_trial(tmp_path, broker, f"broker kill -9 + restart mid-round ({'with' if persistence else 'without'} persistence)",
                   body, rounds=2)  # (dev2 is slow every round)
    finally:
        broker.stop()


def test_device_killed_right_after_publishing(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    """A device dies as soon as the broker acknowledged its update; restarted with the same
    workdir it does not train that round again, and its update counts once."""

    def body(run: Run, trial: int) -> None:
        r = 1 + (1 + trial) % R
        dev1 = run.device("dev1", fault=f"crash_after_publish:{r}")
        dev2 = run.device("dev2")
        coord = run.coordinator()
        run.killed(dev1)
        run.finish(coord, [run.device("dev1"), dev2])

    each_trial(tmp_path, mosquitto, "device kill -9 right after publishing", body)


def damage(path: Path, how: str, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: rng.randrange(len(data) // 2, len(data) - 1)]))
    else:
        i = rng.randrange(32, len(data))  # past the header: the body's checksum must see it
        data[i] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bit-flipped", "truncated"])
def test_damaged_checkpoint_is_reported_and_the_previous_one_used(mosquitto: MosquittoBroker,
                                                                  tmp_path: Path, how: str) -> None:
    """The latest checkpoint damaged while the coordinator was down: reported by name,
    never loaded; the one before it is, and the rounds after it are replayed from their
    kept plans and inboxes."""

    def body(run: Run, trial: int) -> None:
        devs = run.all_devices()
        run.killed(run.coordinator(f"aggregate:{2 + trial % (R - 1)}"))
        damage(run.out / "checkpoint.msgpack", how, random.Random(trial))
        run.finish(run.coordinator(resume=True), devs)
        corrupt = [r for r in run.logs() if r.get("event") == "corrupt"]
        assert corrupt and corrupt[0]["path"].endswith("checkpoint.msgpack"), run.logs()[-5:]

    each_trial(tmp_path, mosquitto, f"{how} checkpoint file", body)


@pytest.mark.parametrize("how", ["bit-flipped", "truncated"])
def test_damaged_inbox_record_is_reported_and_re_sent(mosquitto: MosquittoBroker, tmp_path: Path,
                                                      how: str) -> None:
    """An acked inbox record damaged while the coordinator was down: reported by name
    (file and offset), skipped; its device re-sends the update when the resumed
    coordinator announces the round again."""

    def body(run: Run, trial: int) -> None:
        k = 1 + (2 + 2 * trial) % UPDATES  # a round's first update
        r = 1 + (k - 1) // len(DEVICES)
        devs = run.all_devices()
        run.killed(run.coordinator(f"after_ack:{k}"))
        damage(run.out / "inbox" / f"r{r:06d}.log", how, random.Random(trial))
        run.finish(run.coordinator(resume=True), devs)
        msgs = [r["msg"] for r in run.logs() if "fail their length or checksum" in r.get("msg", "")]
        assert msgs and f"r{r:06d}.log" in msgs[0]

    each_trial(tmp_path, mosquitto, f"{how} inbox record", body)


def buffered_check(run: Run, acked: list[tuple[str, int]]) -> None:
    """A buffered run: versions 1..R once each, every update (device, ticket) counted once,
    each of ``acked`` (persisted and acknowledged before the kill) among them, and the
    exact model ``w_0 + Σ_versions Σ n s(τ) shift / Σ n``."""
    st = RunState(run.out)
    lines = st.read_metrics()
    assert [m["round"] for m in lines] == list(range(1, run.rounds + 1)), lines
    counted = [(u["device"], u["ticket"]) for m in lines for u in m["updates"]]
    assert len(counted) == len(set(counted)) == 2 * run.rounds, counted
    assert set(acked) <= set(counted), (acked, counted)
    ck = st.load_checkpoint()
    assert ck is not None and ck.completed_round == run.rounds
    dev = {d: (s, n) for d, s, n in run.devices}
    move = sum(sum(dev[u["device"]][1] * u["weight"] * dev[u["device"]][0] for u in m["updates"])
               / sum(dev[u["device"]][1] for u in m["updates"]) for m in lines)
    for w, w0 in zip(ck.weights, init_shared(get_spec("mlp"), 0), strict=True):
        np.testing.assert_allclose(w, w0 + move, atol=1e-5, rtol=0)


def test_buffered_coordinator_killed_mid_buffer_resumes(mosquitto: MosquittoBroker, tmp_path: Path) -> None:
    """Buffered mode (buffer of 2, 2 devices, 3 versions): the coordinator killed with -9
    just after acknowledging an update of an open buffer (or, every other trial, just
    before): the resumed coordinator replays the buffer from its inbox, continues the
    version sequence, and counts every acknowledged update once (a redelivered copy is
    dropped as answered)."""
    for trial in range(trials()):
        d = tmp_path / f"t{trial}"
        d.mkdir()
        run = Run(d, mosquitto.url, job=f"b{trial}", rounds=R,
                  coordinator_args=("--mode", "buffered", "--buffer-size", "2", "--concurrency", "2"))
        point, k = ("after_ack", "before_ack")[trial % 2], 3 + trial % 3
        try:
            devs = run.all_devices()
            run.killed(run.coordinator(f"{point}:{k}"))
            acked = []
            for log in sorted((run.out / "inbox").glob("r*.log")):
                for dev, payload in RunState(run.out).inbox_items(int(log.stem[1:]), unique=False):
                    acked.append((dev, decode_message(payload).ticket))
            assert acked, "nothing was persisted before the kill"
            run.finish(run.coordinator(resume=True), devs)
            buffered_check(run, acked)
        except BaseException:
            report(f"buffered coordinator kill -9 {point.replace('_', ' ')} mid-buffer", trial, "FAILED")
            raise
        finally:
            run.close()
        report(f"buffered coordinator kill -9 {point.replace('_', ' ')} mid-buffer", trial,
               "run completed; versions continued; every acked update counted once; exact model")
