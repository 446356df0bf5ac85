"""Ingest workers' pieces without processes (``coordinator.ingest_workers``; the workers
themselves, over mosquitto: tests/system/faults/test_worker_kill.py): strategies that cannot
fold a round in parts refuse the option at config load; partial sums of integer devices
add up to one process's sums bit for bit; every process's inbox log of a round is read
and pruned; the workers' users reach the broker's password files and ACL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.config import ServerConfig
from coordinator.ingest import Ingest
from coordinator.job import load_job
from coordinator.ops.credentials import COORDINATOR_USER, JobSecurity
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared, to_shared
from edge_client.protocol import Update
from edge_client.runtime import encode_update_tensors
from firmware_models import get_spec


@pytest.mark.parametrize("key,value,culprit", [
    ("strategy_params.robust", "median", "holds the round's updates"),
    ("strategy", "prowd", "reads every update"),
    ("privacy.secure_aggregation", True, "privacy"),
])
def test_strategies_that_cannot_fold_in_parts_refuse_workers_at_load(key: str, value: object, culprit: str) -> None:
    with pytest.raises(ConfigError, match=rf"ingest\.workers: .*{culprit}"):
        load_job(None, {"out": "x", "ingest.workers": 2, key: value})
    assert load_job(None, {"out": "x", key: value}).ingest_workers == 0  # (fine without workers)
    assert load_job(None, {"out": "x", "ingest.workers": 2, "strategy": "fedshift"}).ingest_workers == 2


def _int_updates(n: int, model: str = "mlp") -> list:
    spec = get_spec(model)
    ingest = Ingest(model, [tuple(s) for s in spec.param_shapes()], ServerConfig().limits)
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        ints = [rng.integers(-128, 128, s, dtype=np.int8) for s in spec.param_shapes()]
        t = encode_update_tensors(to_shared(ints, 8), spec.param_names(), "int", 8, int_weights=ints, compute_bits=8)
        out.append(lambda k=k, t=t: ingest.encoded(Update(f"d{k}", 1, 10 + 3 * k, 8, "weights", t)))
    return out


def test_partial_sums_of_integer_devices_add_up_bit_for_bit() -> None:
    """Nine updates folded in one instance, and in three parts (uneven, interleaved)
    whose partial sums a fourth instance adds to the one it folded itself (a dead
    worker's log): the same model, bit for bit."""
    base = init_shared(get_spec("mlp"), 0)
    ups = _int_updates(9)
    one = build_strategy("fedshift")
    one.begin_round(1, base)
    for u in ups:
        one.fold(u())
    want = one.finish().weights
    combiner, parts = build_strategy("fedshift"), [build_strategy("fedshift") for _ in range(3)]
    combiner.begin_round(1, base)
    for p in parts:
        p.begin_round(1, base)
    for k, u in enumerate(ups[:8]):
        parts[(k * k) % 3].fold(u())  # 4, 1 and 3 updates
    combiner.fold(ups[8]())
    for p in parts:
        combiner.fold_partial(p.partial())
    got = combiner.finish()
    assert all(np.array_equal(a, b) for a, b in zip(got.weights, want, strict=True))
    assert got.stats["n_updates"] == 9


def test_every_process_log_of_a_round_is_read_and_pruned(tmp_path: Path) -> None:
    main, w0 = RunState(tmp_path), RunState(tmp_path, inbox_tag="w0-1")
    main.inbox_put(3, "a", b"1")
    w0.inbox_put(3, "b", b"2")
    w0.inbox_put(3, "a", b"again")  # a second copy: the first record of a device wins
    w0.inbox_put(4, "c", b"3")
    assert main.inbox_items(3) == [("a", b"1"), ("b", b"2")]
    assert main.inbox_items(3, tag="w0-1") == [("b", b"2"), ("a", b"again")]
    main.inbox_prune(4)
    assert main.inbox_items(3) == [] and main.inbox_items(4) == [("c", b"3")]


def test_the_workers_users_reach_the_password_files_and_acl(tmp_path: Path) -> None:
    sec = JobSecurity(tmp_path / "sec", "j")
    sec.save_job_info("mqtt://127.0.0.1:1883", tls=False)
    sec.coordinator("mqtt://127.0.0.1:1883", tls=False)
    sec.set_ingest_workers(2)
    users = [f"{COORDINATOR_USER}-ingest-{i}" for i in range(2)]
    own = sec.coordinator_passwd_path.read_text().splitlines()
    assert [line.split(":")[0] for line in own] == [COORDINATOR_USER, *users]
    assert len({line.split(":", 1)[1] for line in own}) == 1  # the coordinator's password
    acl = sec.acl_path.read_text()
    for u in users:
        assert f"user {u}\ntopic read fedbit/j/update/+\n" in acl
    sec.set_ingest_workers(0)
    assert "ingest" not in sec.acl_path.read_text() and len(sec.coordinator_passwd_path.read_text().split()) == 1
