"""The papers' settings reach the devices (issue 12).

Each setting is changed on the coordinator only; a real coordinator runs a round over the
in-process fleet with real device runtimes and real trainers, and the test looks at what a
device sent (captured where the strategy folds it) against a reference trainer built here
from the same model, data and seed: integer devices bit for bit, float devices to float32
rounding. Then the integer forms of FedProx / FedFOR against the float devices'.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import ServerConfig
from coordinator.emulation.papers import PAPERS, paper_settings
from coordinator.fleet import InProcessFleet
from coordinator.server import Coordinator
from coordinator.state import RunState
from coordinator.strategies import build_strategy
from edge_client.codecs import decode, encode
from edge_client.codecs.kmeans import fit_codebook
from edge_client.data import digits_shard
from edge_client.errors import ConfigError
from edge_client.intnn import from_shared, init_shared
from edge_client.intnn import kernels as K
from edge_client.protocol import Hello, ModelMessage, RoundAnnouncement, decode_message
from edge_client.runtime import DeviceConfig, DeviceRuntime, int_delta
from edge_client.trainers import IntTrainer, make_trainer
from firmware_models import get_spec
from hw_profiles import ProfileError, parse_profile

JOB = "settings"
MODEL = "mlp"
SPEC = get_spec(MODEL)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def shard(k: int) -> object:
    return digits_shard(k, 8)  # ~180 samples


class Run:
    """One coordinator run; ``updates[r][dev]`` what each device sent in round r (as
    folded), ``start[r]`` (global weights, server state) each round began from."""

    def __init__(self, co: Coordinator, updates, start) -> None:
        self.co, self.updates, self.start = co, updates, start

    def shared(self, r: int, dev: str, bits: int) -> list[np.ndarray]:
        """Device ``dev``'s update of round r decoded to the shared domain (float32)."""
        out = []
        for t in self.updates[r][dev].tensors:
            a = decode(t)
            out.append(a.astype(np.float32) / (1 << (max(bits, 8) - 1)) if a.dtype.kind == "i" else a)
        return out


def run(tmp: Path, devices: list[dict], *, strategy: str = "fedavg", params: dict | None = None,
        hparams: dict | None = None, rounds: int = 1) -> Run:
    """``devices``: dicts of DeviceConfig fields (``device_id``, ``compute_bits``, ``trainer``,
    ``codec``, ``codec_bits``, optional ``seed``, ``kmeans_method``) plus ``data``."""
    fleet = InProcessFleet(JOB)
    strat = build_strategy(strategy, **(params or {}))
    updates: dict[int, dict] = {}
    start: dict[int, tuple] = {}
    fold, begin = strat.fold, strat.begin_round

    def spy_fold(eu):
        updates.setdefault(strat.round_id, {})[eu.device_id] = eu
        fold(eu)

    def spy_begin(r, weights):
        start[r] = ([np.array(w) for w in weights], strat.server_state())
        begin(r, weights)

    strat.fold, strat.begin_round = spy_fold, spy_begin
    threads = []
    for d in devices:
        d = dict(d)
        data = d.pop("data")
        cfg = DeviceConfig(job=JOB, workdir=tmp / d["device_id"], **d)
        rt = DeviceRuntime(cfg, data, fleet.device_connector(cfg.device_id))
        th = threading.Thread(target=rt.run, kwargs={"max_seconds": 120}, daemon=True)
        th.start()
        threads.append(th)
    cfg = ServerConfig(job=JOB, model=MODEL, rounds=rounds, min_devices=len(devices),
                       round_timeout_s=60, presence_timeout_s=60,
                       hparams={"steps": 8, "batch": 32} | (hparams or {}))
    co = Coordinator(cfg, fleet, strat, RunState(tmp / "out"), evaluator=None,
                     init_weights=init_shared(SPEC, 0))
    co.run()
    for th in threads:
        th.join(30)
    fleet.close()
    return Run(co, updates, start)


def float_device(dev: str, k: int, codec: str = "float32", bits: int = 32, **kw) -> dict:
    return {"device_id": dev, "compute_bits": 32, "trainer": "torch", "codec": codec,
            "codec_bits": bits, "seed": k, "data": shard(k)} | kw


def int8_device(dev: str, k: int, codec: str = "int", bits: int = 8, **kw) -> dict:
    return {"device_id": dev, "compute_bits": 8, "trainer": "int", "codec": codec,
            "codec_bits": bits, "seed": k, "data": shard(k)} | kw


def reference(bits: int, seed: int, data, calls: list[tuple[list[np.ndarray], dict]]):
    """A fresh trainer like the device's, trained call by call: (start weights, train kwargs)."""
    tr = make_trainer(SPEC, bits, seed=seed)
    for weights, kw in calls:
        tr.load_shared(weights)
        tr.train(data, **({"steps": 8, "batch": 32} | kw))
    return tr


def close(a: list[np.ndarray], b: list[np.ndarray], atol: float = 2e-6) -> bool:
    return all(np.allclose(x, y, rtol=0, atol=atol) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ 1. FedWSQ


def test_fedwsq_devices_standardize_weights_and_quantize_the_update_by_the_servers_sigma(tmp_path):
    """Strategy ``fedwsq`` only: the float device trains with weight standardization and
    sends its update DANUQ-2 quantized, standardized in round 2 by the server's σ_g (not
    its own σ); the Int8 device reports that it cannot standardize, and it is counted."""
    f, i = float_device("f", 1), int8_device("i", 2)
    res = run(tmp_path, [f, i], strategy="fedwsq", params={"bits": 2}, rounds=2)
    for r in (1, 2):
        for dev in ("f", "i"):
            eu = res.updates[r][dev]
            assert eu.kind == "delta" and {(t.codec, t.bits) for t in eu.tensors} == {("danuq", 2)}
    # round 1: exactly the DANUQ code of a weight-standardized float trainer's update
    g1 = res.start[1][0]
    for ws, same in ((True, True), (False, False)):
        tr = reference(32, 1, f["data"], [(g1, {"weight_standardization": ws})])
        want = [encode(w - g, "danuq", 2).data for w, g in zip(tr.to_shared(), g1, strict=True)]
        got = [t.data for t in res.updates[1]["f"].tensors]
        assert (got == want) is same
    # round 2: standardized by the server's σ_g (the round-1 σ_loc mean), not its own σ
    sigma_g = res.start[2][1]["sigma_g"]
    assert sigma_g is not None and len(sigma_g) == len(SPEC.param_shapes())
    for t, sg in zip(res.updates[2]["f"].tensors, sigma_g, strict=True):
        assert t.aux["sigma_g"] == pytest.approx(float(np.float32(sg)), rel=1e-7)
        assert t.aux["sigma_g"] != t.aux["sigma_loc"]
    assert res.updates[1]["i"].not_applied.keys() == {"ws"}
    assert res.co.history[0]["counts"]["not_applied_ws"] == 1
    assert res.updates[1]["f"].not_applied == {}


def test_a_setting_not_applied_every_round_is_logged_once_and_counted_every_round(tmp_path, caplog):
    """The Int8 device cannot standardize weights, in either round: the coordinator and
    the device each log that at WARNING once (then at DEBUG), and every round counts it."""
    caplog.set_level(logging.DEBUG)
    res = run(tmp_path, [float_device("f", 1), int8_device("i", 2)], strategy="fedwsq",
              params={"bits": 2}, rounds=2)
    assert [h["counts"]["not_applied_ws"] for h in res.co.history] == [1, 1]
    server = [r for r in caplog.records if "did not apply" in r.getMessage()]
    device = [r for r in caplog.records if "announced settings not applied" in r.getMessage()]
    for records in (server, device):
        assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG]


# ------------------------------------------------------------------ 2. FedProx on Int8


def test_fedprox_mu_reaches_an_int8_device(tmp_path):
    res = run(tmp_path, [int8_device("i", 3)], hparams={"prox_mu": 0.01})
    g = res.start[1][0]
    got = res.shared(1, "i", 8)
    with_mu = reference(8, 3, shard(3), [(g, {"prox_mu": 0.01})]).to_shared()
    without = reference(8, 3, shard(3), [(g, {})]).to_shared()
    assert close(got, with_mu, 0) and not close(got, without, 0)


def _dist(a, b) -> float:
    return float(np.sqrt(sum(np.sum((x.astype(np.float64) - y) ** 2) for x, y in zip(a, b, strict=True))))


def test_fedprox_pulls_int8_and_float_devices_back_by_the_same_relative_amount():
    """mu = 0.01, lr 1, no momentum (FedFOR's and FedWSQ's setting), 60 steps of digits_cnn:
    the update's norm shrinks by r = 1 - |dw(mu)| / |dw(0)|. Measured: float32 0.176-0.183
    (6 seeds), Int8 0.149-0.215 (mean 0.178); before the integer form used the float
    devices' step, Int8 gave ~1/16 of it. Tolerance: the 4-seed Int8 mean within 25% of
    the float value (3 standard errors of that mean)."""
    spec = get_spec("digits_cnn")
    data = digits_shard(1, 4)
    start = init_shared(spec, 1)
    r = {}
    for bits, seeds in ((32, (0, 1)), (8, (0, 1, 2, 3))):
        vals = []
        for seed in seeds:
            norms = []
            for mu in (0.0, 0.01):
                tr = make_trainer(spec, bits, seed=seed)
                tr.load_shared(start)
                tr.train(data, steps=60, batch=32, prox_mu=mu, lr=1.0, momentum=0.0)
                norms.append(_dist(tr.to_shared(), start))
            vals.append(1 - norms[1] / norms[0])
        r[bits] = float(np.mean(vals))
    assert r[32] > 0.1, r
    assert abs(r[8] - r[32]) <= 0.25 * r[32], r


# ------------------------------------------------------------------ 3. FedFOR on Int8


def test_fedfor_alpha_reaches_an_int8_device(tmp_path):
    """Round 1 has no last global step (FedAvg); in round 2 the Int8 device's update is
    the one a trainer computes with FedFOR on the g the model carried, not without."""
    devs = [int8_device("i", 4), float_device("f", 5)]
    res = run(tmp_path, devs, hparams={"fedfor_alpha": 1.0}, rounds=2)
    (g1, _), (g2, state2) = res.start[1], res.start[2]
    step = state2["last_global_step"]
    assert step is not None and max(float(np.abs(s).max()) for s in step) > 0
    got = res.shared(2, "i", 8)
    for alpha, same in ((1.0, True), (0.0, False)):
        tr = reference(8, 4, shard(4), [(g1, {"fedfor_alpha": alpha}),
                                         (g2, {"fedfor_alpha": alpha, "last_global_step": step})])
        assert close(got, tr.to_shared(), 0) is same


def test_fedfor_g_of_1e3_keeps_its_sign_pattern_on_int8():
    """g = +-1e-3 (0.128 LSB of Int8's grid, which rounds it to 0): the integer g keeps
    every sign, and one FedFOR step moves each weight by alpha * g * S on average, in the
    direction -g, also on Int16's grid."""
    rng = np.random.default_rng(0)
    for bits, scale in ((8, 128), (16, 32768)):
        tr = IntTrainer(SPEC, bits, seed=0, lr=1.0, momentum=0.0)
        g = [rng.choice([-1e-3, 1e-3], size=s).astype(np.float32) for s in SPEC.param_shapes()]
        reg = tr._regularizer(0.0, 1.0, g, 1.0, 0.0)
        assert reg is not None and reg.alpha_q > 0
        for p, op in enumerate(tr.model.param_ops):
            assert np.array_equal(np.sign(tr.model._to_spec(op, reg.step_g[p])), np.sign(g[p]))
        # one step of the term alone (zero data gradient), each weight displaced along +g
        w0 = tr.model.w[0].reshape(-1)
        gi = reg.step_g[0].reshape(-1)
        wmax = tr.model.wmax
        w = np.clip(np.where(gi > 0, 10, -10), -wmax, wmax).astype(w0.dtype)
        anchor = np.zeros_like(w)
        extra = np.zeros(w.size, np.int64)
        K.regularizer_terms(w, anchor, 0, reg.d_shift, gi, reg.alpha_q, extra)
        before = w.astype(np.int64)
        K.sgd_update(w, np.zeros(w.size, np.int32), -1, 0, wmax, tr.model.thr, 1,
                     np.zeros(w.size, np.int8), extra, reg.shift, K.stream_key(0, 0, 0, 1), 0, 0,
                     0, w.size)
        moved = before - w  # = alpha g S per step in expectation (1e-3 * S LSBs)
        for sign in (1, -1):
            m = moved[np.sign(gi) == sign]
            expect = sign * 1e-3 * scale
            assert abs(m.mean() - expect) < 4 * np.sqrt(abs(expect) / m.size) + 1e-9, (bits, m.mean(), expect)


def test_regularizer_terms_match_numpy_bit_for_bit():
    """The kernel against the formula in int64 numpy, at the largest coefficients the
    trainer allows (mu_q + 2 alpha_q = 2^31) and the widest grid differences."""
    rng = np.random.default_rng(3)
    for bits, dtype in ((8, np.int8), (16, np.int16)):
        wmax = (1 << (bits - 2)) - 1
        n = 5000
        w = rng.integers(-wmax, wmax + 1, n).astype(dtype)
        anchor = rng.integers(-wmax, wmax + 1, n).astype(dtype)
        g = rng.integers(-(1 << 30), 1 << 30, n).astype(np.int32)
        g[::7] = 0
        d_shift = 30 - bits
        for mu_q, alpha_q in ((1 << 31, 0), (0, 1 << 30), (1 << 30, 1 << 29), (10486, 3)):
            out = np.zeros(n, np.int64)
            K.regularizer_terms(w, anchor, mu_q, d_shift, g, alpha_q, out)
            d = w.astype(np.int64) - anchor
            want = (mu_q * d) * (1 << d_shift) + np.where(g * d > 0, alpha_q * g.astype(np.int64), 0)
            assert np.array_equal(out, want), (bits, mu_q, alpha_q)


def test_fedfor_term_is_nonzero_on_int8_for_g_of_1e3():
    """Training with g = +-1e-3 changes the Int8 update (it did not when g was rounded onto
    the grid): FedFOR's penalty sum_j max(0, g_j (w_j - w_t,j)) falls (measured 0.44 / 0.38
    of its value without the term for seeds 0 / 1), and where the term acts the weights
    moved against g (92-94% of the changed ones)."""
    spec = get_spec("digits_cnn")
    data = digits_shard(2, 4)
    start = init_shared(spec, 2)
    rng = np.random.default_rng(1)
    g = [rng.choice([-1e-3, 1e-3], size=s).astype(np.float32) for s in spec.param_shapes()]
    sg = np.concatenate([x.ravel() for x in g])
    moves = []
    for alpha in (0.0, 2.0):
        tr = IntTrainer(spec, 8, seed=0, lr=1.0, momentum=0.0)
        tr.load_shared(start)
        q0 = [q.astype(np.int32) for q in tr.int_weights()]
        tr.train(data, steps=30, batch=32, fedfor_alpha=alpha, last_global_step=g)
        moves.append(np.concatenate([(q - b).ravel() for q, b in zip(tr.int_weights(), q0, strict=True)]))
    penalty = [float(np.maximum(0, sg * m).sum()) for m in moves]
    assert penalty[1] < 0.6 * penalty[0], penalty
    diff = moves[1] - moves[0]
    acting = (sg * moves[0] > 0) & (diff != 0)
    assert acting.sum() > 1000
    assert np.mean(np.sign(diff[acting]) == -np.sign(sg[acting])) > 0.85


# ------------------------------------------------------------------ 4. FedPAQ


def test_fedpaq_devices_send_their_quantized_update(tmp_path):
    devs = [float_device("f", 1, "asym", 4), int8_device("i", 2)]
    paq = run(tmp_path / "paq", devs, strategy="fedpaq", params={"weighted": False})
    avg = run(tmp_path / "avg", devs, strategy="fedavg", params={"weighted": False})
    assert {eu.kind for eu in avg.updates[1].values()} == {"weights"}
    assert {eu.kind for eu in paq.updates[1].values()} == {"delta"}
    g = paq.start[1][0]
    # the float device: ASYM-4 of W - W_global (within half a quantization step)
    ref = reference(32, 1, shard(1), [(g, {})]).to_shared()
    for t, w, g0 in zip(paq.updates[1]["f"].tensors, ref, g, strict=True):
        d = w - g0
        half = (float(d.max()) - float(d.min())) / 15 / 2
        assert np.abs(decode(t) - d).max() <= half + 1e-6
    # the Int8 device: its own integer update q - q_global, exact, in the bits it needs
    ref8 = reference(8, 2, shard(2), [(g, {})]).int_weights()
    want = int_delta(ref8, from_shared(g, 8))
    for t, q in zip(paq.updates[1]["i"].tensors, want, strict=True):
        need = int(np.abs(q.astype(np.int64)).max()).bit_length() + 1
        assert t.codec == "int" and t.bits == max(2, need) and np.array_equal(decode(t), q)
    # the new global model moved by the mean of the decoded updates
    mean = [(a + b) / 2 for a, b in zip(paq.shared(1, "f", 32), paq.shared(1, "i", 8), strict=True)]
    assert close(paq.co.weights, [g0 + m for g0, m in zip(g, mean, strict=True)], 1e-6)


# ------------------------------------------------------------------ 5. learning rates


def test_announced_lr_and_momentum_reach_a_float_device(tmp_path):
    res = run(tmp_path, [float_device("f", 1)], hparams={"lr": 0.1, "momentum": 0.0})
    g = res.start[1][0]
    got = res.shared(1, "f", 32)
    assert close(got, reference(32, 1, shard(1), [(g, {"lr": 0.1, "momentum": 0.0})]).to_shared())
    assert not close(got, reference(32, 1, shard(1), [(g, {})]).to_shared())


def test_announced_float_forward_reaches_a_float_device(tmp_path):
    """``float_forward = "int8"``: the float device trains the Int8 forward (its update is
    the reference trainer's in that forward, not in the float one); the Int8 device trains
    as before and reports nothing."""
    res = run(tmp_path, [float_device("f", 1), int8_device("i", 2)], hparams={"float_forward": "int8"})
    g = res.start[1][0]
    got = res.shared(1, "f", 32)
    assert close(got, reference(32, 1, shard(1), [(g, {"forward": "int8"})]).to_shared())
    assert not close(got, reference(32, 1, shard(1), [(g, {})]).to_shared())
    assert res.updates[1]["i"].not_applied == {} and res.updates[1]["f"].not_applied == {}
    assert close(res.shared(1, "i", 8), reference(8, 2, shard(2), [(g, {})]).to_shared(), atol=0)


def test_grouped_avg_scales_each_groups_learning_rate(tmp_path):
    """FedGroupedAvg with ``scale_lr`` (ProWD): 2 float + 2 Int8 devices, each group half
    of the round: float devices train with lr * 0.5, Int8 devices with lr_shift 3 - 1."""
    devs = [float_device("f1", 1), float_device("f2", 2), int8_device("i1", 3), int8_device("i2", 4)]
    res = run(tmp_path, devs, strategy="grouped", params={"scale_lr": True}, hparams={"lr": 0.2})
    g = res.start[1][0]
    for dev, k in (("f1", 1), ("f2", 2)):
        assert close(res.shared(1, dev, 32), reference(32, k, shard(k), [(g, {"lr": 0.1})]).to_shared())
        assert not close(res.shared(1, dev, 32), reference(32, k, shard(k), [(g, {"lr": 0.2})]).to_shared())
    for dev, k in (("i1", 3), ("i2", 4)):
        assert close(res.shared(1, dev, 8), reference(8, k, shard(k), [(g, {"lr_shift": 2})]).to_shared(), 0)
        assert not close(res.shared(1, dev, 8), reference(8, k, shard(k), [(g, {})]).to_shared(), 0)


# ------------------------------------------------------------------ 6. K-means method


def test_kmeans_method_from_the_announcement_and_from_the_profile(tmp_path):
    """A Raspberry Pi 5 style device (Int8, kmeans-4 uplink): by default its codebooks are
    the fast method's; ``kmeans_method = "authors"`` announced, or set in its profile,
    gives the FedShift code's (random init seeded by device seed and round)."""
    dev = int8_device("p5", 6, "kmeans", 4)
    cases = {"default": ({}, {}), "announced": ({"kmeans_method": "authors"}, {}),
             "profile": ({}, {"kmeans_method": "authors"})}
    for name, (hp, cfg) in cases.items():
        res = run(tmp_path / name, [dev | cfg], hparams=hp)
        w = reference(8, 6, shard(6), [(res.start[1][0], {})]).to_shared()
        method = "fast" if name == "default" else "authors"
        for t, x in zip(res.updates[1]["p5"].tensors, w, strict=True):
            want = fit_codebook(x.reshape(-1), 4, method=method, seed=[6, 1])
            other = fit_codebook(x.reshape(-1), 4, method="authors" if method == "fast" else "fast", seed=[6, 1])
            assert np.array_equal(np.float32(t.aux["codebook"]), want), name
            assert not np.array_equal(want, other)


def test_profile_kmeans_method_is_validated():
    base = {"name": "b", "arch": "aarch64", "compute_bits": 8, "trainer": "int", "codec": "kmeans",
            "codec_bits": 4, "ram_mb": 512, "uplink_kbps": 100.0, "downlink_kbps": 100.0,
            "latency_ms": 1.0, "loss_rate": 0.0, "relative_speed": 1.0}
    assert parse_profile(base).kmeans_method == "fast"
    p = parse_profile(base | {"kmeans_method": "authors"})
    assert DeviceConfig.from_profile("d", p).kmeans_method == "authors"
    with pytest.raises(ProfileError, match="kmeans_method"):
        parse_profile(base | {"kmeans_method": "sklearn"})


# ------------------------------------------------------------------ 7. averaging weights


def test_unweighted_averaging_is_one_parameter(tmp_path):
    """Two devices with 4x different sample counts: ``weighted=False`` (the FedShift and
    ProWD papers' 1/N) gives the plain mean of their updates, the default the sample-weighted one."""
    a = float_device("a", 1) | {"data": digits_shard(1, 4)}
    b = float_device("b", 2) | {"data": digits_shard(2, 16)}
    n = {"a": len(a["data"].y), "b": len(b["data"].y)}
    for weighted in (False, True):
        res = run(tmp_path / str(weighted), [a, b], params={"weighted": weighted})
        ua, ub = res.shared(1, "a", 32), res.shared(1, "b", 32)
        wa, wb = (n["a"], n["b"]) if weighted else (1, 1)
        want = [(wa * x + wb * y) / (wa + wb) for x, y in zip(ua, ub, strict=True)]
        assert close(res.co.weights, want, 1e-6)
    for name in ("fedshift", "prowd", "prowd-grouped"):
        assert PAPERS[name].strategy_params["weighted"] is False


def test_paper_settings_validate_and_build():
    for name in PAPERS:
        p = paper_settings(name, fedfor_alpha=0.5) if name == "fedfor" else paper_settings(name)
        strat = build_strategy(p.strategy, **p.strategy_params)
        ServerConfig(strategy=p.strategy, hparams=p.hparams).validate(strat)
    with pytest.raises(ConfigError, match="fedfor_alpha"):
        paper_settings("fedfor")
    with pytest.raises(ConfigError, match="nope"):
        paper_settings("nope")


# ------------------------------------------------------------------ validation and reports


@pytest.mark.parametrize("hparams,key", [
    ({"lrr": 0.1}, "lrr"),
    ({"lr": 0.0}, "lr"),
    ({"momentum": 1.0}, "momentum"),
    ({"prox_mu": -1}, "prox_mu"),
    ({"content": "both"}, "content"),
    ({"kmeans_method": "sklearn"}, "kmeans_method"),
    ({"lr_scale.int9x": 0.5}, "lr_scale.int9x"),
    ({"ws": 1}, "ws"),
    ({"run": "x"}, "run"),
])
def test_bad_announced_hparams_are_config_errors_naming_the_key(hparams, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ServerConfig(hparams=hparams).validate()


def test_a_configured_value_that_contradicts_the_strategy_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="content"):
        ServerConfig(hparams={"content": "weights"}).validate(build_strategy("fedpaq"))
    with pytest.raises(ConfigError, match="codec_bits"):
        ServerConfig(hparams={"codec_bits": 4}).validate(build_strategy("fedwsq", bits=2))
    with pytest.raises(ConfigError, match="bits"):
        build_strategy("fedwsq", bits=12)
    with pytest.raises(ConfigError, match="content"):
        Coordinator(ServerConfig(model=MODEL, hparams={"content": "weights"}), InProcessFleet(JOB),
                    build_strategy("fedpaq"), RunState(tmp_path), evaluator=None,
                    init_weights=init_shared(SPEC, 0))
    s = build_strategy("grouped", scale_lr=True)
    hellos = [Hello(f"d{i}", "p", b, "int" if b < 32 else "torch", "int", 8, 10, "0")
              for i, b in enumerate((8, 8, 8, 32))]
    assert s.device_hparams({"lr": 0.1}, hellos) == {"lr": 0.1, "lr_scale.float32": 0.25,
                                                     "lr_scale.int8": 0.75}


def test_a_device_reports_what_it_cannot_honour(tmp_path):
    """An announcement the device cannot honour (here built by hand: a coordinator would
    refuse these keys) is listed in its update with the reason; training goes on."""
    cfg = DeviceConfig("d", 8, "int", "int", 8, job=JOB, workdir=tmp_path)
    rt = DeviceRuntime(cfg, shard(1), connect=lambda **kw: None)
    from coordinator.variants import model_tensors
    from edge_client.protocol import tensors_digest

    t8 = model_tensors(init_shared(SPEC, 0), SPEC.param_names(), "int8")
    m = ModelMessage(1, "int8", MODEL, t8, tensors_digest(t8))
    a = RoundAnnouncement(JOB, 1, MODEL, ("d",), 1e12, {"int8": m.digest},
                          {"steps": 2, "foo": 1, "lr": -1.0, "ws": True, "codec": "float16",
                           "codec_bits": 3, "lr_scale.float32": 0.5, "run": "r"})
    upd = decode_message(rt.train_round(a, m))
    assert set(upd.not_applied) == {"foo", "lr", "ws", "codec_bits"}
    assert "unknown" in upd.not_applied["foo"] and "range" in upd.not_applied["lr"]
    assert {(t.codec, t.bits) for t in upd.tensors} == {("float16", 16)}  # announced codec


def test_round_settings_device_rules():
    from edge_client.hparams import round_settings

    st = round_settings({}, variant="int8", codec="danuq", codec_bits=2)
    assert st.content == "delta" and st.not_applied == {}  # DANUQ quantizes the update
    st = round_settings({}, variant="float32", codec="kmeans", codec_bits=4)
    assert (st.content, st.kmeans_method, st.lr, st.ws) == ("weights", "fast", None, None)
    st = round_settings({"codec": "danuq", "lr_scale": 0.5, "lr_scale.int8": 0.25, "lr_shift": 2,
                         "grad_clip": 1.0}, variant="int8", codec="int", codec_bits=8)
    assert (st.codec, st.codec_bits, st.content) == ("danuq", 8, "delta")  # bits clamped to 1..8
    assert (st.lr_scale, st.lr_shift, st.grad_clip) == (0.25, 2, None)
    st = round_settings({"lr_scale.int8": 0.25, "lr_shift": 2, "codec": "int"}, variant="float32",
                        codec="float32", codec_bits=32)
    assert (st.lr_scale, st.lr_shift, st.codec) == (1.0, None, "float32")
    assert set(st.not_applied) == {"codec"}


def test_update_not_applied_on_the_wire_is_optional_and_checked():
    import msgpack

    from edge_client.errors import ProtocolError
    from edge_client.protocol import Update, encode_message, float32_tensor

    t = (float32_tensor(np.zeros(3, np.float32)),)
    body = msgpack.unpackb(encode_message(Update("d", 1, 5, 32, "weights", t, not_applied={"ws": "no"})))
    assert decode_message(msgpack.packb(body)).not_applied == {"ws": "no"}
    old = {k: v for k, v in body.items() if k != "not_applied"}  # an older device's update
    assert decode_message(msgpack.packb(old)).not_applied == {}
    with pytest.raises(ProtocolError, match="not_applied"):
        decode_message(msgpack.packb(body | {"not_applied": {"ws": 1}}))


def test_an_integer_device_under_another_bitwidths_forward_is_reported_at_info(tmp_path, caplog):
    """An Int6 device under ``float_forward = "int8"`` (the default demo's fleet) trains its
    own forward: it reports that every round and the coordinator counts it, but the first
    report is logged at INFO on both sides (expected in a mixed fleet), then at DEBUG."""
    caplog.set_level(logging.DEBUG)
    int6 = int8_device("i6", 2, compute_bits=6)
    res = run(tmp_path, [float_device("f", 1), int6], hparams={"float_forward": "int8"}, rounds=2)
    assert [h["counts"]["not_applied_float_forward"] for h in res.co.history] == [1, 1]
    assert "int6" in res.updates[1]["i6"].not_applied["float_forward"]
    server = [r for r in caplog.records if "did not apply" in r.getMessage()]
    device = [r for r in caplog.records if "announced settings not applied" in r.getMessage()]
    for records in (server, device):
        assert [r.levelno for r in records] == [logging.INFO, logging.DEBUG]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "float_forward" in r.getMessage()]
