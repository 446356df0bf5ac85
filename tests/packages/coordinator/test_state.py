"""Durable coordinator state: atomic files, checkpoints, the inbox, metrics repair."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from coordinator.state import Checkpoint, RoundPlan, RunState, atomic_write, dumps, loads
from edge_client.errors import ConfigError
from edge_client.outbox import Outbox


def test_atomic_write_replaces_and_leaves_no_temp_files(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    atomic_write(p, b"one")
    atomic_write(p, b"two")
    assert p.read_bytes() == b"two"
    assert sorted(os.listdir(tmp_path)) == ["f.bin"]


def test_run_files_are_the_operators_alone(tmp_path: Path) -> None:
    """Raw updates, models and the device list: 0600 whatever the umask (the inbox 0700)."""
    old = os.umask(0o022)
    try:
        st = RunState(tmp_path)
        st.inbox_append(1, "a", b"update bytes")
        st.inbox_sync()
        st.append_metrics({"round": 1})
        st.save_plan(RoundPlan(round_id=1, selected=["a"], deadline=1.0, variants={}))
        st.save_devices({"a": {"device_id": "a"}})
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 4 and {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}, files
    assert (tmp_path / "inbox").stat().st_mode & 0o777 == 0o700


def test_dumps_roundtrips_arrays_and_int_keys() -> None:
    obj = {"w": [np.arange(6, dtype=np.float32).reshape(2, 3)], 8: {"x": np.int16(3)}}
    back = loads(dumps(obj))
    np.testing.assert_array_equal(back["w"][0], obj["w"][0])
    assert back["w"][0].dtype == np.float32 and back["w"][0].flags.writeable
    assert back[8]["x"] == 3


def test_checkpoint_roundtrip_including_rng_state(tmp_path: Path) -> None:
    st = RunState(tmp_path)
    rng = np.random.default_rng(7)
    rng.random(5)
    ck = Checkpoint(job="j", model="mlp", completed_round=3,
                    weights=[np.ones((2, 2), np.float32)], group_weights={8: [np.zeros(3, np.float32)]},
                    strategy_state={"sigma_g": [0.5, 0.25]},
                    rng_state={"json": json.dumps(rng.bit_generator.state)},
                    metrics={"round": 3, "accuracy": 0.5}, devices={"d1": {"device_id": "d1"}})
    st.save_checkpoint(ck)
    back = st.load_checkpoint()
    assert back is not None and back.completed_round == 3
    np.testing.assert_array_equal(back.weights[0], ck.weights[0])
    assert list(back.group_weights) == [8]
    r2 = np.random.default_rng(0)
    r2.bit_generator.state = json.loads(back.rng_state["json"])
    assert r2.random() == rng.random()   # the selection RNG continues where it stopped
    (tmp_path / "checkpoint.msgpack").write_bytes(b"\xc1junk")
    with pytest.raises(ConfigError, match="checkpoint"):
        st.load_checkpoint()


def test_inbox_log_append_sync_items_prune(tmp_path: Path) -> None:
    st = RunState(tmp_path)
    st.inbox_put(2, "b", b"B")
    st.inbox_append(2, "a", b"A")
    st.inbox_append(2, "b", b"B-again")      # a duplicate record: the first one wins
    st.inbox_sync()
    st.inbox_put(3, "a", b"A3")
    assert st.inbox_has(2, "a") and not st.inbox_has(2, "c")
    assert st.inbox_items(2) == [("b", b"B"), ("a", b"A")]
    # a fresh process reads the same records
    assert RunState(tmp_path).inbox_items(2) == [("b", b"B"), ("a", b"A")]
    st.inbox_prune(3)
    assert st.inbox_items(2) == [] and st.inbox_items(3) == [("a", b"A3")]


def test_inbox_log_ignores_a_torn_tail(tmp_path: Path) -> None:
    st = RunState(tmp_path)
    st.inbox_put(1, "a", b"x" * 100)
    st.inbox_put(1, "b", b"y" * 100)
    log = tmp_path / "inbox" / "r000001.log"
    data = log.read_bytes()
    log.write_bytes(data[:-10])                # killed in the middle of the second record
    assert RunState(tmp_path).inbox_items(1) == [("a", b"x" * 100)]
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF                        # a flipped byte fails the checksum
    log.write_bytes(bytes(corrupt))
    assert RunState(tmp_path).inbox_items(1) == [("a", b"x" * 100)]
    zeroed = bytearray(data)
    zeroed[-60:-20] = bytes(40)                # a block that never reached the disk
    log.write_bytes(bytes(zeroed))
    assert RunState(tmp_path).inbox_items(1) == [("a", b"x" * 100)]


def test_inbox_reads_logs_of_the_crc32_record_format(tmp_path: Path) -> None:
    """A log written before the 64-bit checksum (FBU1 records, CRC-32) still replays,
    followed by records of the current format."""
    import struct
    import zlib

    (tmp_path / "inbox").mkdir()
    log = tmp_path / "inbox" / "r000003.log"
    did, payload = b"old", b"p" * 33
    log.write_bytes(struct.pack("<4sIIH", b"FBU1", len(payload), zlib.crc32(payload, zlib.crc32(did)),
                                len(did)) + did + payload)
    st = RunState(tmp_path)
    st.inbox_put(3, "new", b"q" * 5)
    assert RunState(tmp_path).inbox_items(3) == [("old", b"p" * 33), ("new", b"q" * 5)]


@settings(max_examples=300, deadline=None)
@given(data=hst.binary(max_size=300), seed=hst.integers(0, 2**64 - 1), cut=hst.integers(0, 299))
def test_checksum_matches_its_reference_and_sees_changes(data: bytes, seed: int, cut: int) -> None:
    from coordinator.checksum import checksum, checksum_reference

    c = checksum(data, seed)
    assert c == checksum_reference(data, seed)
    assert checksum(memoryview(b"_" + data)[1:], seed) == c  # an unaligned buffer
    if data:
        i = cut % len(data)
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        assert checksum(bytes(flipped), seed) != c
        assert checksum(data[:i], seed) != c  # truncated


def test_plan_roundtrip(tmp_path: Path) -> None:
    st = RunState(tmp_path)
    assert st.load_plan() is None
    plan = RoundPlan(4, ["a", "b"], 123.5, {"float32": "0" * 64}, {"epochs": 1})
    st.save_plan(plan)
    assert st.load_plan() == plan


def test_repair_metrics_keeps_exactly_one_line_per_completed_round(tmp_path: Path) -> None:
    st = RunState(tmp_path)
    for r in (1, 2, 2, 3, 4):
        st.append_metrics({"round": r, "accuracy": 0.1 * r})
    with open(st.metrics_path, "a") as f:
        f.write('{"round": 5, "accur')          # torn by a crash
    ck = Checkpoint(job="j", model="mlp", completed_round=3, weights=[], metrics={"round": 3})
    st.repair_metrics(ck)
    assert [m["round"] for m in st.read_metrics()] == [1, 2, 3]
    # crash between the checkpoint and the metrics append: restored from the checkpoint
    ck4 = Checkpoint(job="j", model="mlp", completed_round=4, weights=[], metrics={"round": 4, "x": 1})
    st.repair_metrics(ck4)
    assert st.read_metrics()[-1] == {"round": 4, "x": 1}


def test_a_non_finite_figure_is_written_as_null_and_the_round_kept(tmp_path: Path) -> None:
    """A rolled-back round scored on validation only carries NaN test accuracies in its
    health record: the line is strict JSON with null there, and nothing else changes."""
    st = RunState(tmp_path)
    st.append_metrics({"round": 1, "accuracy": float("nan"), "loss": np.float64("inf"),
                       "health": {"rolled_back_accuracy": {"int8": float("nan"), "float32": 0.5}},
                       "history": [1.0, float("-inf")]})
    line = st.metrics_path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"round": 1, "accuracy": None, "loss": None,
                                "health": {"rolled_back_accuracy": {"int8": None, "float32": 0.5}},
                                "history": [1.0, None]}


def test_outbox_keeps_only_the_open_round(tmp_path: Path) -> None:
    ob = Outbox(tmp_path / "ob")
    ob.put(3, "fedbit/j/update/d1", b"r3")
    ob.put(4, "fedbit/j/update/d1", b"r4")
    items = ob.pending()
    assert [(i.round_id, i.topic, i.payload()) for i in items] == [
        (3, "fedbit/j/update/d1", b"r3"), (4, "fedbit/j/update/d1", b"r4")]
    assert ob.discard_closed(4) == 1
    assert [i.round_id for i in ob.pending()] == [4]
    ob.remove(ob.pending()[0])
    assert len(ob) == 0
    assert not [p for p in (tmp_path / "ob").iterdir()]   # no temp files left behind
