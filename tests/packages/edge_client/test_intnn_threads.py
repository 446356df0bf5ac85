"""Training on several threads inside one process: the kernels release the GIL, a step's
large kernels are split into disjoint parts, and the result is the same bit for bit as on
one thread for the same seed."""

from __future__ import annotations

import numpy as np
import pytest

import edge_client.intnn.allocation as W
from edge_client.compat import zip_strict
from edge_client.data import Dataset
from edge_client.errors import ConfigError
from edge_client.intnn import IntModel, init_int
from edge_client.intnn import kernels as K
from edge_client.intnn.parallel import Splitter, Task, split_range
from edge_client.trainers import IntTrainer
from firmware_models import Conv2d, Flatten, Linear, MaxPool2d, ModelSpec, ReLU, get_spec


def every_path_spec() -> ModelSpec:
    """A first conv whose error the pool writes at plane positions, a conv with K*C >= 32
    (error-driven gradient, backward-data), an overlapping pool (routed, then masked), a
    stride-1 conv not followed by a pool (its errors converted to plane positions), a
    lone ReLU, two linears."""
    return ModelSpec("paths", (3, 12, 12), (
        Conv2d("c1", 3, 8, 3, padding=1), ReLU("r1"), MaxPool2d("p1", 2),
        Conv2d("c2", 8, 8, 5, padding=2), ReLU("r2"), MaxPool2d("p2", 3, 2, 1),
        Conv2d("c3", 8, 4, 3, padding=1), ReLU("r3"), Flatten("f"),
        Linear("l1", 36, 20), ReLU("r4"), Linear("l2", 20, 5),
    ), 5)


def data(spec: ModelSpec, n: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.random((n, *spec.input_shape), dtype=np.float32)
    return Dataset(x, rng.integers(0, spec.num_classes, n).astype(np.int64))


def train(spec: ModelSpec, bits: int, threads: int, d: Dataset, **kw) -> tuple[list, float]:
    tr = IntTrainer(spec, bits, seed=3, threads=threads)
    r = tr.train(d, steps=4, batch=16, **kw)
    tr.model.close()
    if len(d.x) % 16:  # a partial batch too: the backward's tasks were built for both sizes
        assert sorted(tr.model.workspace(16).plans) == [len(d.x) % 16, 16]
    return tr.int_weights(), r.loss


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_any_number_of_threads_gives_the_same_weights_bit_for_bit(monkeypatch, bits):
    monkeypatch.setattr(W, "SPLIT_MIN_MACS", 0)  # split every op, however small
    spec = every_path_spec()
    d = data(spec, 37, bits)  # batches of 16, 16, 5, 16
    one, loss1 = train(spec, bits, 1, d, prox_mu=0.05)
    for threads in (2, 3):
        many, loss = train(spec, bits, threads, d, prox_mu=0.05)
        assert loss == loss1
        for a, b in zip_strict(one, many):
            assert a.dtype == b.dtype and np.array_equal(a, b), (bits, threads)
    model = IntModel(spec, bits, threads=3)
    model.workspace(16)
    assert all(op.split for op in model.ops if op.param >= 0)


def test_the_default_split_follows_the_work():
    """With 2 threads only the large ops are split (a hand-off costs a few us)."""
    model = IntModel(get_spec("fedshift_cnn"), 8, threads=2)
    model.workspace(32)
    split = {op.layer.name: op.split for op in model.ops if op.param >= 0}
    assert split == {"conv1": True, "conv2": True, "fc1": True, "fc2": False}
    one = IntModel(get_spec("fedshift_cnn"), 8, threads=1)
    one.workspace(32)
    assert not any(op.split for op in one.ops)


def test_training_kernels_release_the_gil():
    for kernel in K.TRAINING_KERNELS:
        assert kernel.targetoptions.get("nogil") is True, kernel.py_func.__name__


def test_split_ranges_cover_everything_once_and_keep_the_alignment():
    for total, parts, align in ((75, 2, 2), (51200, 3, 256), (4096 * 512, 2, 512), (5, 8, 1),
                                (3, 2, 4), (0, 2, 1)):
        ranges = split_range(total, parts, align)
        covered = [i for lo, hi in ranges for i in range(lo, hi)] if total < 10_000 else None
        assert len(ranges) <= parts
        assert all(lo % align == 0 for lo, _ in ranges)
        if covered is not None:
            assert covered == list(range(total))
        else:
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_a_part_that_fails_does_not_leave_the_others_running():
    seen = []

    def kernel(i):
        if i == 0:
            raise RuntimeError("part 0 failed")
        seen.append(i)
        return i

    sp = Splitter(3)
    with pytest.raises(RuntimeError, match="part 0"):
        sp.run(kernel, lambda t, lo, hi: (t,), 30)
    assert sorted(seen) == [1, 2]  # both other parts finished before the error surfaced
    sp.close()


def test_a_pool_threads_failure_is_raised_in_the_caller_and_the_splitter_goes_on():
    def kernel(i):
        if i == 2:
            raise ValueError("part 2 failed")
        return i * 10

    sp = Splitter(3)
    with pytest.raises(ValueError, match="part 2"):
        sp.run(kernel, lambda t, lo, hi: (t,), 30)
    assert sp.run(kernel, lambda t, lo, hi: (t if t != 2 else 5,), 30) == [0, 10, 50]
    sp.close()


def test_parts_are_handed_over_after_the_pool_threads_went_to_sleep(monkeypatch):
    """Past their spin, the pool threads sleep on a condition and the caller too when a
    part takes long: a part posted then still runs, and its result still arrives."""
    import time

    import edge_client.intnn.parallel as P

    monkeypatch.setattr(P, "IDLE_SPIN_S", 0.0)  # the fewest spins: sleep almost at once
    monkeypatch.setattr(P, "RESULT_SPIN_S", 0.0)

    def kernel(part, delay):
        time.sleep(delay)  # the pool thread's part outlasts the caller's spin
        return part

    sp = Splitter(2)
    for _ in range(3):
        assert sp.run(kernel, lambda t, lo, hi: (t, 0.02 * t), 2) == [0, 1]
        time.sleep(0.02)  # the pool thread stops spinning and sleeps
    sp.close()


def test_close_ends_the_pool_threads_and_a_later_run_starts_them_again():
    import gc
    import threading

    def names():
        return {t.name for t in threading.enumerate() if t.name.startswith("fedbit-intnn")}

    before = names()
    sp = Splitter(3)
    assert sp.run(lambda t: t, lambda t, lo, hi: (t,), 3) == [0, 1, 2]
    assert len(names() - before) == 2
    sp.close()
    assert names() == before
    assert sp.run(lambda t: t, lambda t, lo, hi: (t,), 3) == [0, 1, 2]
    assert len(names() - before) == 2
    del sp  # never closed: its threads end when it is collected
    gc.collect()
    for _ in range(100):
        if names() == before:
            break
        threading.Event().wait(0.01)
    assert names() == before


def test_the_spin_wait_reads_a_flag_another_thread_writes():
    import threading

    from edge_client.intnn.spin import wait_for

    flags = np.zeros(3, np.int64)
    assert wait_for(flags, 2, 0, 1) and not wait_for(flags, 2, 1, 1000)
    setter = threading.Timer(0.01, lambda: flags.__setitem__(1, 7))
    setter.start()
    assert wait_for(flags, 1, 7, 1 << 40)  # would spin for hours if the read were hoisted
    setter.join()


def test_a_chain_runs_each_part_through_every_kernel_in_order():
    """run_chain: every part runs the tasks in order on its own range (one hand-off), the
    parts together cover the range once; on one thread, one part."""
    import threading

    for threads in (1, 3):
        log: list = []

        def first(part, lo, hi, log=log):
            log.append(("a", part, lo, hi, threading.get_ident()))

        def second(part, lo, hi, log=log):
            assert ("a", part, lo, hi, threading.get_ident()) in log  # same thread, earlier
            log.append(("b", part, lo, hi, threading.get_ident()))

        sp = Splitter(threads)
        sp.run_chain([(first, lambda t, lo, hi: (t, lo, hi)),
                      (second, lambda t, lo, hi: (t, lo, hi))], 32, align=4)
        sp.close()
        ranges = sorted((lo, hi) for tag, _, lo, hi, _ in log if tag == "a")
        assert ranges == sorted((lo, hi) for tag, _, lo, hi, _ in log if tag == "b")
        assert ranges == split_range(32, threads, 4) and len(ranges) == threads


def test_a_group_runs_part_p_of_every_task_on_one_thread_and_keeps_each_task_s_results():
    """run_group: tasks split differently share one hand-off; part p of each task runs on
    thread p in the tasks' order, an unsplit task on the calling thread, a task with fewer
    parts (or none: total 0) leaves the other threads to the rest; results per part."""
    import threading

    def args(tag):
        return lambda part, lo, hi: (tag, part, lo, hi)

    for threads in (1, 2, 3):
        log: list = []

        def kernel(tag, part, lo, hi, log=log):
            log.append((tag, part, lo, hi, threading.get_ident()))
            return (tag, lo, hi)

        tasks = [Task(kernel, args("rows"), 10), Task(kernel, args("samples"), 32, align=4),
                 Task(kernel, args("one"), 7, split=False), Task(kernel, args("small"), 2),
                 Task(kernel, args("none"), 0)]
        sp = Splitter(threads)
        sp.run_group(tasks)
        sp.close()
        plans = [split_range(10, threads), split_range(32, threads, 4), [(0, 7)],
                 split_range(2, threads), []]
        for task, plan in zip_strict(tasks, plans):
            tag = task.args(0, 0, 0)[0]
            assert task.results == [(tag, lo, hi) for lo, hi in plan]
            assert sorted((a, b) for name, _, a, b, _ in log if name == tag) == plan
        by_part: dict = {}
        for _, part, _, _, ident in log:
            by_part.setdefault(part, set()).add(ident)
        assert all(len(idents) == 1 for idents in by_part.values())  # part p: one thread
        assert by_part[0] == {threading.get_ident()}  # part 0 (and "one"): the caller
        order = ["rows", "samples", "one", "small"]
        for part in by_part:  # each thread runs its parts in the tasks' order
            tags = [tag for tag, p, *_ in log if p == part]
            assert tags == sorted(tags, key=order.index)


def test_a_two_thread_step_hands_work_over_once_per_group(monkeypatch):
    """fedshift_cnn on two threads: the forward is one hand-off, the backward's stages
    overlap in four (fc1's gradient with its error, its update with conv2's error,
    conv2's gradient with conv1's error, conv2's update with conv1's gradient)."""
    from edge_client.intnn import parallel

    spec = get_spec("fedshift_cnn")
    model = IntModel(spec, 8, threads=2)
    model.load_int(init_int(spec, 0, 8))
    ws = model.workspace(8)
    rng = np.random.default_rng(0)
    ws.x[:8] = model.prepare_inputs(rng.random((8, *spec.input_shape), dtype=np.float32))
    y = rng.integers(0, 10, 8).astype(np.int64)
    posts: list = []
    real = parallel._Part.post
    monkeypatch.setattr(parallel._Part, "post", lambda self, k, a: posts.append(k) or real(
        self, k, a))
    model.train_step(ws, y, 8, 3, 0, 0)
    model.close()
    # fc2 and conv1's update are not split (no hand-off); one stage a group took nine
    assert 1 < len(posts) <= 5, len(posts)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", 257])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ConfigError, match="threads"):
        IntModel(get_spec("digits_cnn"), 8, threads=bad)


def test_a_device_trains_on_its_profile_s_threads_unless_told_otherwise(tmp_path):
    from edge_client.runtime import DeviceConfig, DeviceRuntime
    from hw_profiles import load_profile

    spec = get_spec("digits_cnn")
    d = data(spec, 8, 0)
    for overrides, want in (({}, 4), ({"threads": 2}, 2)):
        cfg = DeviceConfig.from_profile("pi", load_profile("raspberry-pi-4"),
                                        workdir=tmp_path / "pi", **overrides)
        rt = DeviceRuntime(cfg, d, lambda **kw: None)
        _, trainer = rt._trainer("digits_cnn")
        assert trainer.model.splitter.threads == want


def test_fedbit_edge_run_refuses_a_bad_thread_count(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "edge_client.cli", "run", "--profile",
                          "raspberry-pi-4", "--data", "digits:1/4", "--id", "dev-1",
                          "--broker", "mqtt://127.0.0.1:1", "--workdir", str(tmp_path),
                          "--threads", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "threads must be an integer in 1..256, got 0" in out.stderr
