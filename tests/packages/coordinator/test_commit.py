"""The background group commit: sync before ack, acks in order, errors surface."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from coordinator.commit import AckCommitter


def test_every_ack_follows_a_sync_that_covers_it_in_order() -> None:
    appended: list[int] = []
    synced_upto = [0]
    acked: list[int] = []
    lock = threading.Lock()

    def sync() -> None:
        time.sleep(0.002)  # an fdatasync
        with lock:
            synced_upto[0] = len(appended)

    def ack(m: int) -> None:
        with lock:
            assert m < synced_upto[0], f"acked {m} before a sync covered it"
        acked.append(m)

    c: AckCommitter[int, int] = AckCommitter(sync, ack)
    for b in range(50):
        batch = [3 * b, 3 * b + 1, 3 * b + 2]
        with lock:
            appended.extend(batch)
        c.submit(batch)
    c.drain(timeout=10)
    assert acked == list(range(150))
    assert c.pending() == 0


def test_a_failed_sync_acks_nothing_and_raises_in_the_caller() -> None:
    acked: list[int] = []

    def sync() -> None:
        raise OSError("disk gone")

    c: AckCommitter[int, int] = AckCommitter(sync, acked.append)
    c.submit([1, 2])
    with pytest.raises(OSError, match="disk gone"):
        c.drain(timeout=10)
    with pytest.raises(OSError):
        c.submit([3])
    with pytest.raises(OSError):
        c.check()
    assert acked == []


def test_records_are_persisted_in_order_before_the_sync_that_acks_them() -> None:
    log: list[str] = []
    persisted: list[int] = []

    def persist(r: int) -> None:
        assert threading.current_thread().name == "fedbit-persist"
        persisted.append(r)
        log.append(f"p{r}")

    def sync() -> None:
        log.append(f"s{len(persisted)}")

    def ack(m: int) -> None:
        assert m == 99 or m in persisted, f"acked {m} before it was persisted"
        log.append(f"a{m}")

    c: AckCommitter[int, int] = AckCommitter(sync, ack, persist=persist)
    for b in range(20):
        batch = [2 * b, 2 * b + 1]
        c.submit(batch, batch)
    c.submit([99])  # a batch with nothing accepted (all rejected): acked after a sync
    c.drain(timeout=10)
    assert persisted == list(range(40))
    assert [e for e in log if e[0] == "a"] == [f"a{m}" for m in [*range(40), 99]]
    # every ack comes after a sync that counted its record
    synced = 0
    for e in log:
        if e[0] == "s":
            synced = int(e[1:])
        elif e[0] == "a" and e != "a99":
            assert int(e[1:]) < synced


def test_a_failed_persist_acks_nothing_and_raises_in_the_caller() -> None:
    acked: list[int] = []

    def persist(r: int) -> None:
        raise OSError("disk full")

    c: AckCommitter[int, int] = AckCommitter(lambda: None, acked.append, persist=persist)
    c.submit([1, 2], [1])
    with pytest.raises(OSError, match="disk full"):
        c.drain(timeout=10)
    assert acked == []
    with pytest.raises(ValueError, match="persist"):
        AckCommitter(lambda: None, acked.append).submit([1], [1])


def test_the_threads_exit_when_idle_and_restart_on_demand() -> None:
    acked: list[str] = []
    persisted: list[str] = []
    c: AckCommitter[str, str] = AckCommitter(lambda: None, acked.append, persist=persisted.append,
                                             idle_exit_s=0.05)
    c.submit(["a"], ["ra"])
    started = list(c._threads.values())
    c.drain(timeout=10)
    end = time.monotonic() + 5
    while any(t.is_alive() for t in started) and time.monotonic() < end:
        time.sleep(0.02)
    assert started and not any(t.is_alive() for t in started)
    for i in range(200):  # submits racing with threads about to exit still get done
        c.submit([f"m{i}"], [f"r{i}"] if i % 2 else [])
        time.sleep(0.0005 * (i % 7))
    c.drain(timeout=10)
    assert acked == ["a", *[f"m{i}" for i in range(200)]]
    assert persisted == ["ra", *[f"r{i}" for i in range(1, 200, 2)]]


def test_busy_threads_are_not_restarted_by_the_other_stage_s_wakeups() -> None:
    """Each stage's notify wakes the other stage's idle thread too; that is not idleness:
    over a stream of batches (gaps far below idle_exit_s) each stage runs on one thread
    (a thread start costs the loop ~1 ms on a loaded machine)."""
    persist_threads: set[int] = set()
    ack_threads: set[int] = set()
    c: AckCommitter[int, int] = AckCommitter(
        lambda: None, lambda m: ack_threads.add(threading.get_ident()),
        persist=lambda r: persist_threads.add(threading.get_ident()), idle_exit_s=30.0)
    for i in range(60):
        c.submit([i], [i] if i % 3 else [])
        time.sleep(0.003)
    c.drain(timeout=10)
    assert len(persist_threads) == 1 and len(ack_threads) == 1


def test_a_message_without_records_is_not_acked_before_earlier_records_persist() -> None:
    order: list[str] = []
    gate = threading.Event()

    def persist(r: str) -> None:
        gate.wait(5)
        order.append(f"p:{r}")

    c: AckCommitter[str, str] = AckCommitter(lambda: order.append("sync"), lambda m: order.append(f"a:{m}"),
                                             persist=persist)
    c.submit(["u1"], ["u1"])
    c.submit(["rejected"])  # nothing to persist, but behind u1
    time.sleep(0.05)
    assert order == []
    gate.set()
    c.drain(timeout=10)
    assert order.index("p:u1") < order.index("sync") < order.index("a:u1") < order.index("a:rejected")


def test_decode_buffers_are_reused_only_once_nothing_holds_them() -> None:
    from coordinator.strategies.buffers import LayerBufferPool

    pool = LayerBufferPool([(3, 4), (5,)], max_sets=2)
    a = pool.take()
    b = pool.take()
    assert pool.allocated == 2 and a[0] is not b[0]
    view = a[1].reshape(-1)  # a strategy keeping a view of one layer
    del a
    c = pool.take()  # both pooled sets are still referenced: an unpooled one
    assert pool.allocated == 3 and all(x is not y for x, y in zip(c, b, strict=True))
    del view
    d = pool.take()
    assert pool.allocated == 3  # the first set, free again
    assert [x.shape for x in d] == [(3, 4), (5,)] and all(x.dtype == np.float32 for x in d)
    assert all(x.flags.c_contiguous and x.flags.writeable for x in d)
