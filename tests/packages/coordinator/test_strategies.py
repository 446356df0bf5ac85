"""Aggregation stages: each equation on tiny hand-computed tensors, streaming properties,
validation, server state and checkpoints. What every strategy promises (fold order, a
checkpoint between rounds, an empty round) is in ``test_strategy_conformance.py``."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from coordinator.strategies import (
    AggregateResult,
    ClientUpdate,
    available_strategies,
    build_strategy,
)
from coordinator.strategies.mask import split_bits
from edge_client.errors import ConfigError, ProtocolError

G = [np.zeros((2, 2), np.float32), np.zeros(3, np.float32)]


def upd(dev, w, n=1, bits=32, lossy=False, kind="weights", sigma=None):
    return ClientUpdate(dev, n, [np.asarray(x, np.float32) for x in w], kind, bits, lossy, sigma)


def run(name, updates, glob=G, **params) -> AggregateResult:
    s = build_strategy(name, **params)
    s.begin_round(1, glob)
    for u in updates:
        s.accept(u)
    return s.finish()


def layers(*vals):
    """One update's two layers filled with constants a (2x2) and b (3,)."""
    a, b = vals
    return [np.full((2, 2), a), np.full(3, b)]


def test_names_and_unknown():
    names = available_strategies()
    for n in ("fedavg", "fedshift", "prowd-swa", "prowd-swa+fedshift", "grouped", "grouped-asym", "fedpaq"):
        assert n in names
        assert build_strategy(n).name == n
    with pytest.raises(ConfigError, match="fedshift"):
        build_strategy("fedfoo")
    with pytest.raises(ConfigError, match="unknown parameters"):
        build_strategy("fedavg", tau=0.1)
    with pytest.raises(ConfigError):
        build_strategy("prowd-swa", tau=2.0)
    with pytest.raises(ConfigError, match="dequantizer"):
        build_strategy("fedavg", dequantize="magic")


def test_fedavg_weighted_and_unweighted():
    ups = [upd("a", layers(1, 2), n=1), upd("b", layers(4, -1), n=3)]
    r = run("fedavg", ups)
    np.testing.assert_allclose(r.weights[0], np.full((2, 2), (1 + 12) / 4))
    np.testing.assert_allclose(r.weights[1], np.full(3, (2 - 3) / 4))
    r = run("fedavg", ups, weighted=False)
    np.testing.assert_allclose(r.weights[0], np.full((2, 2), 2.5))
    assert r.weights[0].dtype == np.float32 and r.weights[0].shape == (2, 2)


def test_fedshift_hand_computed():
    # layer 0 avg of [[1,2],[3,4]] and [[3,4],[5,6]] = [[2,3],[4,5]], m = 3.5; I/N = 1/2
    ups = [upd("a", [[[1, 2], [3, 4]], [0, 0, 0]]), upd("b", [[[3, 4], [5, 6]], [1, 2, 3]], lossy=True)]
    r = run("fedshift", ups)
    np.testing.assert_allclose(r.weights[0], [[2 - 1.75, 3 - 1.75], [4 - 1.75, 5 - 1.75]])
    np.testing.assert_allclose(r.weights[1], np.array([0.5, 1, 1.5]) - 0.5 * 1.0)
    assert r.stats["n_inferior"] == 1 and r.stats["n_updates"] == 2
    assert r.stats["shift_mean/0"] == pytest.approx(3.5)


def test_fedshift_counts_integer_devices_as_inferior():
    ups = [upd("a", layers(1, 1)), upd("b", layers(3, 3), bits=8), upd("c", layers(2, 2), lossy=True, bits=8)]
    r = run("fedshift", ups)
    assert r.stats["n_inferior"] == 2
    np.testing.assert_allclose(r.weights[0], np.full((2, 2), 2 - (2 / 3) * 2), rtol=1e-6)


def test_fedshift_equals_fedavg_without_lossy_updates():
    rng = np.random.default_rng(0)
    ups = [upd(f"d{i}", [rng.standard_normal((2, 2)), rng.standard_normal(3)], n=i + 1) for i in range(5)]
    a, b = run("fedavg", ups), run("fedshift", ups)
    for x, y in zip(a.weights, b.weights, strict=True):
        np.testing.assert_array_equal(x, y)


def test_fedshift_mean_is_s_over_n_times_m():
    # paper eq. 9: mean(w_FS) = (S/N)·m on every layer
    rng = np.random.default_rng(1)
    glob = [np.zeros((8, 4), np.float32), np.zeros(50, np.float32)]
    ups = [upd(f"d{i}", [rng.normal(0.3, 1, (8, 4)), rng.normal(-0.2, 1, 50)], lossy=i < 3) for i in range(7)]
    avg = run("fedavg", ups, glob)
    fs = run("fedshift", ups, glob)
    for a, f in zip(avg.weights, fs.weights, strict=True):
        m = a.astype(np.float64).mean()
        assert f.astype(np.float64).mean() == pytest.approx((4 / 7) * m, rel=1e-5, abs=1e-7)


def test_fedpaq_adds_average_delta():
    glob = [np.full((2, 2), 1.0, np.float32), np.full(3, -1.0, np.float32)]
    ups = [upd("a", layers(0.5, 1), kind="delta", n=1), upd("b", layers(-0.5, 3), kind="delta", n=1)]
    r = run("fedpaq", ups, glob, server_lr=0.5)
    np.testing.assert_allclose(r.weights[0], np.full((2, 2), 1.0))
    np.testing.assert_allclose(r.weights[1], np.full(3, -1.0 + 0.5 * 2))
    # server_lr = 1: identical to FedAvg of the implied weights, deltas and weights mixed
    mixed = [upd("a", layers(1.5, 0), n=2), upd("b", layers(-0.5, 3), kind="delta", n=1)]
    r1, r2 = run("fedpaq", mixed, glob), run("fedavg", mixed, glob)
    np.testing.assert_allclose(r1.weights[0], np.full((2, 2), (3 + 0.5) / 3), rtol=1e-6)
    for x, y in zip(r1.weights, r2.weights, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_grouped_routes_by_bitwidth():
    ups = [upd("f", layers(4, 4), bits=32), upd("i8", layers(2, 2), bits=8, n=3),
           upd("i8b", layers(0, 0), bits=8, n=1), upd("i6", layers(1, 1), bits=6)]
    r = run("grouped", ups)
    assert sorted(r.group_weights) == [6, 8, 32]
    np.testing.assert_allclose(r.group_weights[8][0], np.full((2, 2), 1.5))
    np.testing.assert_allclose(r.group_weights[6][1], np.full(3, 1.0))
    np.testing.assert_allclose(r.weights[0], np.full((2, 2), 4.0))  # the top group's model
    ra = run("grouped-asym", ups)
    np.testing.assert_allclose(ra.group_weights[32][0], np.full((2, 2), 4.0))
    np.testing.assert_allclose(ra.group_weights[8][0], np.full((2, 2), (4 + 6 + 0) / 5))
    np.testing.assert_allclose(ra.group_weights[6][0], np.full((2, 2), (4 + 6 + 0 + 1) / 6))


def test_grouped_keeps_absent_groups_and_uses_group_base_for_deltas():
    s = build_strategy("grouped")
    s.begin_round(1, G)
    s.accept(upd("f", layers(4, 4), bits=32))
    s.accept(upd("i", layers(2, 2), bits=8))
    s.finish()
    s.begin_round(2, G)
    s.accept(upd("f", layers(1, 1), bits=32, kind="delta"))  # base = the 32-bit model (4)
    r = s.finish()
    np.testing.assert_allclose(r.group_weights[32][0], np.full((2, 2), 5.0))
    np.testing.assert_allclose(r.group_weights[8][0], np.full((2, 2), 2.0))  # kept


def test_prowd_swa_masks_low_bit_elements():
    # Δhigh = +1 everywhere; the low-bit update disagrees on one element out of 4 (τ = 0.25)
    glob = [np.zeros(4, np.float32)]
    hi = upd("hi", [[1, 1, 1, 1]], bits=32)
    lo = upd("lo", [[1, 1, 1, -3]], bits=8)
    r = run("prowd-swa", [hi, lo], glob, tau=0.25)
    np.testing.assert_allclose(r.weights[0], [1, 1, 1, 1])  # excluded: high alone there
    assert r.stats["masked_fraction/0"] == pytest.approx(0.25)
    assert r.stats["cos_after/0"] > r.stats["cos_before/0"]
    r = run("prowd-swa", [hi, lo], glob, tau=0.25, fill="literal")
    np.testing.assert_allclose(r.weights[0], [1, 1, 1, 0.5])  # eq. 9 as printed
    r = run("prowd-swa+fedshift", [hi, lo], glob, tau=0.25)
    np.testing.assert_allclose(r.weights[0], np.ones(4) - 0.5 * 1.0)  # lo is inferior (8 bit)


def test_prowd_swa_without_low_or_high_is_fedavg():
    ups = [upd("a", layers(1, 2), bits=8), upd("b", layers(3, -2), bits=8, n=3)]
    a, b = run("fedavg", ups), run("prowd-swa", ups)
    for x, y in zip(a.weights, b.weights, strict=True):
        np.testing.assert_array_equal(x, y)
    assert b.stats["masked_fraction/0"] == 0.0


def test_split_at_mean_bitwidth():
    assert split_bits([8, 32, 32, 8]) == ([8], [32])
    assert split_bits([6, 8, 12, 16]) == ([6, 8], [12, 16])
    assert split_bits([8, 16, 24]) == ([8], [16, 24])
    assert split_bits([8]) == ([], [8])


def test_float32_accumulator_close_to_float64():
    rng = np.random.default_rng(4)
    ups = [upd(f"d{i}", [rng.standard_normal((2, 2)), rng.standard_normal(3)], n=i + 1) for i in range(30)]
    exact = run("fedavg", ups, acc_dtype="float64")
    for fast in (run("fedavg", ups), run("fedavg", ups, acc_dtype="float32", batch=1)):
        for x, y in zip(exact.weights, fast.weights, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (upd("x", [[[np.nan, 0], [0, 0]], [0, 0, 0]]), "NaN or Inf"),
    (upd("x", [[[0, 0], [0, 0]], [0, np.inf, 0]]), "NaN or Inf"),
    (upd("x", [np.zeros((2, 3)), np.zeros(3)]), "shape"),
    (upd("x", [np.zeros((2, 2))]), "layers"),
    (ClientUpdate("x", 1, [np.zeros((2, 2), np.int8), np.zeros(3, np.int8)]), "dtype"),
    (upd("x", layers(0, 0), n=0), "num_samples"),
    (upd("x", layers(0, 0), kind="grads"), "kind"),
    (upd("x", layers(0, 0), bits=64), "compute_bits"),
    (upd("x", layers(0, 0), sigma=[1.0]), "sigma_loc"),
    (upd("x", layers(0, 0), sigma=[1.0, float("nan")]), "sigma_loc"),
])
def test_bad_update_rejected_before_the_sum(bad, match):
    s = build_strategy("fedavg", batch=1)
    s.begin_round(1, G)
    s.accept(upd("good", layers(2, 2)))
    with pytest.raises(ProtocolError, match=match):
        s.accept(bad)
    r = s.finish()
    np.testing.assert_array_equal(r.weights[0], np.full((2, 2), 2.0))
    assert r.stats["n_updates"] == 1


def test_server_state_global_step_sigma_and_checkpoint():
    s = build_strategy("fedavg")
    assert s.server_state() == {"last_global_step": None, "sigma_g": None}
    s.begin_round(1, G)
    s.accept(upd("a", layers(1, 2), sigma=[0.2, 0.4]))
    s.accept(upd("b", layers(3, 2), sigma=[0.4, 0.8]))
    r = s.finish()
    st = s.server_state()
    np.testing.assert_allclose(st["last_global_step"][0], G[0] - r.weights[0])  # g = w_{t-1} - w_t
    assert st["sigma_g"] == pytest.approx([0.3, 0.6])  # first reports: their mean
    s.begin_round(2, r.weights)
    s.accept(upd("a", layers(1, 2), sigma=[1.3, 1.6]))
    s.finish()
    assert s.server_state()["sigma_g"] == pytest.approx([0.9 * 0.3 + 0.1 * 1.3, 0.9 * 0.6 + 0.1 * 1.6])

    blob = msgpack.packb(s.state_dict(), use_bin_type=True)
    t = build_strategy("fedavg")
    t.load_state_dict(msgpack.unpackb(blob, raw=False))
    assert t.server_state()["sigma_g"] == s.server_state()["sigma_g"]
    for x, y in zip(t.server_state()["last_global_step"], s.server_state()["last_global_step"], strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ConfigError):
        build_strategy("fedshift").load_state_dict(s.state_dict())


def test_streaming_holds_no_per_update_state():
    # the accumulator's arrays do not grow with the number of updates
    s = build_strategy("prowd-swa+fedshift", batch=4)
    s.begin_round(1, G)
    for i in range(40):
        s.accept(upd(f"d{i}", layers(i, -i), bits=8 if i % 2 else 32))
        assert len(s._sums._pending) < 4
    assert sorted(s._sums.sums) == [8, 32]
    s.finish()


def test_decode_stage_maps_every_codec_to_the_shared_domain():
    from coordinator.strategies import EncodedUpdate
    from coordinator.strategies.checks import is_lossy
    from coordinator.strategies.decode import decode_update
    from edge_client.codecs import encode
    from edge_client.protocol import float32_tensor

    ts = (float32_tensor(np.ones((2, 2))), float32_tensor(np.arange(3.0)))
    bufs = [np.full((2, 2), 7, np.float32), np.full(3, 7, np.float32)]
    f = decode_update(EncodedUpdate("a", 5, ts, "weights", 32, is_lossy(ts)), bufs)
    assert not f.lossy and f.finite and f.weights[1].tolist() == [0, 1, 2] and f.weights[0].dtype == np.float32
    assert f.weights[0] is bufs[0] or np.shares_memory(f.weights[0], bufs[0])  # decoded into the buffer
    q = np.array([64, -127, 1], np.int8)
    t = (encode(q, "int", 8),)
    u = decode_update(EncodedUpdate("b", 5, t, "weights", 8, is_lossy(t), [0.5]))
    assert not u.lossy and u.inferior and u.sigma_loc == [0.5]  # exact integers, an integer device
    np.testing.assert_allclose(u.weights[0], [0.5, -127 / 128, 1 / 128])  # q / 2^(8-1)
    u16 = decode_update(EncodedUpdate("c", 5, (encode(q.astype(np.int16), "int", 16),), "weights", 16, True))
    np.testing.assert_allclose(u16.weights[0], q / 2.0 ** 15)  # q / 2^(16-1)


@pytest.mark.parametrize("name", ["fedavg", "fedshift", "prowd-swa"])
def test_small_groups_sum_to_the_same_bits_in_any_order(name):
    """Up to `batch` updates per bitwidth group: the result is bit-identical whatever the
    arrival order (the held updates fold in device-id order, one rounding per fold)."""
    rng = np.random.default_rng(11)
    ups = [upd(f"d{i}", [rng.standard_normal((2, 2)), rng.standard_normal(3)], n=i + 1,
               bits=8 if i % 2 else 32, lossy=bool(i % 2)) for i in range(8)]
    ref = run(name, ups)
    for perm in (ups[::-1], ups[3:] + ups[:3], [ups[i] for i in (5, 2, 7, 0, 6, 1, 4, 3)]):
        got = run(name, perm)
        for x, y in zip(ref.weights, got.weights, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_finite_flag_skips_only_the_strategy_side_check():
    """`finite=True` is the producer's word (codec decode verified it): the strategy does
    not re-read the arrays. Without it, the same NaN is rejected before touching the sum."""
    bad = [np.array([[np.nan, 0], [0, 0]], np.float32), np.zeros(3, np.float32)]
    s = build_strategy("fedavg")
    s.begin_round(1, G)
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        s.accept(ClientUpdate("x", 1, bad))
    s.accept(ClientUpdate("y", 1, [np.ones((2, 2), np.float32), np.ones(3, np.float32)], finite=True))
    assert s.finish().weights[0][0, 0] == 1.0
    # float64 input is narrowed to float32, which can overflow: checked even when vouched
    s.begin_round(2, G)
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        s.accept(ClientUpdate("z", 1, [np.full((2, 2), 1e300), np.zeros(3)], finite=True))


def test_fedavgm_applies_server_momentum_to_the_fedavg_step():
    """FedAvgM: v = β·v_prev + (g - avg), w = g - v; round 1 is FedAvg; the momentum is
    the checkpointed last global step, so a restored strategy continues it."""
    s = build_strategy("fedavgm", server_momentum=0.5)
    s.begin_round(1, G)
    s.accept(upd("a", layers(1, 2)))
    s.accept(upd("b", layers(3, 2)))
    r1 = s.finish()
    np.testing.assert_allclose(r1.weights[0], np.full((2, 2), 2.0))     # FedAvg: no momentum yet
    t = build_strategy("fedavgm", server_momentum=0.5)
    t.load_state_dict(msgpack.unpackb(msgpack.packb(s.state_dict(), use_bin_type=True), raw=False))
    for strat in (s, t):
        strat.begin_round(2, r1.weights)
        strat.accept(upd("a", layers(3, 2)))
        r2 = strat.finish()
        # step 1: v = -2; step 2: v = 0.5·(-2) + (2 - 3) = -2 -> w = 2 + 2 = 4 (FedAvg: 3)
        np.testing.assert_allclose(r2.weights[0], np.full((2, 2), 4.0))
        np.testing.assert_allclose(r2.weights[1], np.full(3, 2.0 + 0.5 * 2.0))  # momentum only
    with pytest.raises(ConfigError, match="server_momentum"):
        build_strategy("fedavgm", server_momentum=1.0)
