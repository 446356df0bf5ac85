"""The coordinator's registry with devices registered in bulk (cohorts): a million devices
cost their sample counts, not a hello each; lookups, presence, selection order and the
run state agree with devices registered one by one."""

from __future__ import annotations

import random
import time
import tracemalloc

import numpy as np
import pytest

from coordinator.devices import COHORTS_KEY, Cohort, CohortIds, DeviceRegistry
from coordinator.state import dumps, loads
from edge_client.errors import ConfigError
from edge_client.protocol import Hello, Presence

PI4 = Hello("x", "raspberry-pi-4", 8, "int", "int", 8, 0, "0.1.0")
DESK = Hello("x", "desktop", 32, "torch", "float32", 32, 0, "0.1.0")


def cohorts(n_pi: int = 120, n_desk: int = 30) -> list[Cohort]:
    return [Cohort("raspberry-pi-4-", len(str(n_pi - 1)), n_pi, PI4, np.arange(n_pi) % 7 + 1),
            Cohort("desktop-", len(str(n_desk - 1)), n_desk, DESK, 32)]


def one_by_one(cs: list[Cohort]) -> DeviceRegistry:
    reg = DeviceRegistry()
    for c in cs:
        for i in range(c.count):
            reg.apply(c.hello_of(i))
    return reg


def test_cohorts_answer_like_hellos_registered_one_by_one() -> None:
    cs = cohorts()
    bulk, single = DeviceRegistry(), one_by_one(cs)
    for c in cs:
        bulk.add_cohort(c)
    assert isinstance(bulk.present(), CohortIds)
    assert list(bulk.present()) == single.present()
    assert len(bulk.hellos) == len(single.hellos) == 150 and sorted(bulk.hellos) == sorted(single.hellos)
    assert bulk.hellos["raspberry-pi-4-013"] == single.hellos["raspberry-pi-4-013"]
    assert bulk.hellos["raspberry-pi-4-013"].num_samples == 13 % 7 + 1
    assert bulk.hellos.get("desktop-07") == Hello("desktop-07", "desktop", 32, "torch", "float32", 32, 32, "0.1.0")
    for missing in ("desktop-30", "desktop-7", "desktop-007", "raspberry-pi-4-1x0", "nobody"):
        assert missing not in bulk.hellos and bulk.hellos.get(missing) is None
    assert bulk.variants() == single.variants() == {"int8", "float32"}
    # the server's selection: the same seeded draw picks the same devices
    present = bulk.present()
    idx = np.random.default_rng(3).choice(len(present), size=10, replace=False)
    assert [present[i] for i in idx] == [single.present()[i] for i in idx]


def test_presence_and_own_hellos_of_members_are_tracked() -> None:
    reg = DeviceRegistry()
    for c in cohorts():
        reg.add_cohort(c)
    reg.apply(Presence("desktop-03", False))
    assert "desktop-03" not in reg.present() and len(reg.present()) == 149
    assert "desktop-03" in reg.hellos  # still registered, only offline
    reg.apply(Presence("desktop-03", True))
    assert "desktop-03" in reg.present()
    # a member saying the hello the cohort holds changes nothing; a different one replaces it
    reg.changed = False
    reg.apply(reg.hellos["desktop-04"])
    assert not reg.changed and reg.to_state().keys() == {COHORTS_KEY}
    other = Hello("desktop-04", "desktop", 32, "torch", "kmeans", 4, 99, "0.1.0")
    reg.apply(other)
    assert reg.changed and reg.hellos["desktop-04"] == other and len(reg.hellos) == 150
    # a device outside the cohorts joins the present list in order
    reg.apply(Hello("cam-1", "desktop", 32, "torch", "float32", 32, 5, "0.1.0"))
    assert len(reg.hellos) == 151 and list(reg.present()) == sorted(reg.present())
    assert "cam-1" in reg.present() and len(reg.present()) == 151


def test_cohorts_survive_the_run_state_offline_until_registered_again() -> None:
    reg = DeviceRegistry()
    for c in cohorts():
        reg.add_cohort(c)
    reg.apply(Hello("cam-1", "desktop", 32, "torch", "float32", 32, 5, "0.1.0"))
    back = DeviceRegistry.from_state(loads(dumps(reg.to_state())))
    assert sorted(back.hellos) == sorted(reg.hellos) and back.hellos["raspberry-pi-4-100"] == reg.hellos[
        "raspberry-pi-4-100"]
    assert len(back.present()) == 0  # every device offline until it (or its fleet) speaks
    for c in cohorts():
        back.add_cohort(c)
    assert len(back.present()) == 150
    with pytest.raises(ConfigError, match="another cohort has that prefix"):
        back.add_cohort(Cohort("desktop-", 2, 31, DESK, 32))


def test_interleaving_id_ranges_are_merged_in_order() -> None:
    reg = DeviceRegistry()
    reg.add_cohort(Cohort("pi-", 1, 10, PI4, 1))
    reg.add_cohort(Cohort("pi-4-", 1, 3, PI4, 1))  # "pi-3" < "pi-4-0" < "pi-5"
    ids = [f"pi-{i}" for i in range(10)] + [f"pi-4-{i}" for i in range(3)]
    assert list(reg.present()) == sorted(ids)


@pytest.mark.parametrize("prefix,width,count,why", [
    ("pi4", 2, 10, "ending in a non-digit"), ("pi/", 2, 10, "valid id"), ("pi-", 1, 11, "do not fit"),
    ("pi-", 2, 0, "do not fit")])
def test_bad_cohorts_are_refused(prefix: str, width: int, count: int, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        Cohort(prefix, width, count, PI4, 1)
    with pytest.raises(ConfigError, match="num_samples"):
        Cohort("pi-", 2, 10, PI4, np.ones(9))
    with pytest.raises(ConfigError, match="compute_bits"):
        DeviceRegistry().add_cohort(Cohort("pi-", 2, 10, Hello("x", "p", 3, "int", "int", 8, 0, "v"), 1))


def test_a_million_registered_devices_cost_their_sample_counts() -> None:
    """Registering, counting, listing and selecting from 1,000,000 devices in two cohorts:
    well under a second and 16 MB (one hello each would be over a GB)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    reg = DeviceRegistry()
    for c in cohorts(500_000, 500_000):
        reg.add_cohort(c)
    present = reg.present()
    rng = np.random.default_rng(0)
    picks = [sorted(present[i] for i in rng.choice(len(present), size=10, replace=False)) for _ in range(20)]
    lookups = [reg.hellos[d] for p in picks for d in p]
    state = dumps(reg.to_state())
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(present) == len(reg.hellos) == 1_000_000 and len(lookups) == 200
    assert present[0] == "desktop-000000" and present[-1] == "raspberry-pi-4-499999"
    assert elapsed < 2.0 and peak < 16 * 2**20 and len(state) < 8 * 2**20, (elapsed, peak, len(state))
    d = random.Random(1).choice(lookups).device_id
    assert reg.member(d) is not None and reg.is_online(d)


def test_a_saved_registry_with_cohorts_is_read_by_export_and_the_dashboard() -> None:
    """What ``fedbit export`` and the dashboard read from a run's devices.msgpack: every
    device kind, the count, the first devices by id."""
    from coordinator.devices import state_entries, state_kinds, state_size

    reg = DeviceRegistry()
    for c in cohorts():
        reg.add_cohort(c)
    reg.apply(Hello("cam-1", "jetson-nano", 16, "int", "asym", 8, 5, "0.1.0"))
    state = loads(dumps(reg.to_state()))
    assert state_size(state) == 151
    assert {(h["compute_bits"], h["trainer"]) for h in state_kinds(state)} == {(8, "int"), (32, "torch"), (16, "int")}
    rows = state_entries(state, 3)
    assert [d for d, _ in rows] == ["cam-1", "desktop-00", "desktop-01"] and rows[1][1]["num_samples"] == 32
