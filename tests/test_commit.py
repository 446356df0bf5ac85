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

    c: AckCommitter[int] = AckCommitter(sync, ack)
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

    c: AckCommitter[int] = AckCommitter(sync, acked.append)
    c.submit([1, 2])
    with pytest.raises(OSError, match="disk gone"):
        c.drain(timeout=10)
    with pytest.raises(OSError):
        c.submit([3])
    with pytest.raises(OSError):
        c.check()
    assert acked == []


def test_the_thread_exits_when_idle_and_restarts_on_demand() -> None:
    acked: list[str] = []
    c: AckCommitter[str] = AckCommitter(lambda: None, acked.append, idle_exit_s=0.05)
    c.submit(["a"])
    c.drain(timeout=10)
    time.sleep(0.3)
    assert not any(t.name == "fedbit-committer" and t.is_alive() for t in threading.enumerate()
                   if t is c._thread)
    c.submit(["b"])
    c.drain(timeout=10)
    assert acked == ["a", "b"]


def test_decode_buffers_are_reused_only_once_nothing_holds_them() -> None:
    from coordinator.buffers import LayerBufferPool

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
