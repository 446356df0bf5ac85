"""ProWD's progressive weight dequantizer (``dequantize="prowd"``): identity at
initialization, learning on real digits weights, block shapes for every model spec,
checkpoint -> restore, the held-out gate, the lookup tables, and a training failure
inside a real coordinator round loop. Every configuration here is tiny (short ladders,
one epoch): seconds in all."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

from coordinator.strategies import ClientUpdate, build_strategy
from coordinator.strategies.prowd_dequantizer import DequantizerConfig, ProwdDequantizer
from coordinator.strategies.prowd_dequantizer.blocks import BlockLayout
from coordinator.strategies.prowd_dequantizer.ladder import grid_precision, quantize
from coordinator.strategies.prowd_dequantizer.network import build_network
from coordinator.strategies.prowd_dequantizer.train import train_network
from coordinator.strategies.prowd_dequantizer.version import (
    Version,
    heldout_l1,
    make_tables,
    run_direct,
)
from edge_client.data import load_digits
from edge_client.errors import ConfigError
from edge_client.intnn import init_shared
from edge_client.trainers import TorchTrainer
from firmware_models import MODELS, get_spec

torch = pytest.importorskip("torch")

DIGITS = get_spec("digits_cnn")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def digits_weights() -> list[list[np.ndarray]]:
    """Four digits_cnn models trained by float32 devices from one global model, as in a
    federated round: the global model (2 local epochs on a shard), then 3 devices' local
    epoch on their own shards (about a second in all)."""
    train = load_digits("train")
    shards = [train.subset(np.arange(k, len(train), 4)) for k in range(4)]
    t = TorchTrainer(DIGITS, seed=0)
    t.train(shards[0], epochs=2, batch=32)
    glob = t.to_shared()
    models = [glob]
    for k in (1, 2, 3):
        d = TorchTrainer(DIGITS, seed=k)
        d.load_shared(glob)
        d.train(shards[k], epochs=1, batch=32)
        models.append(d.to_shared())
    return models


def _cfg(**kw) -> DequantizerConfig:
    return DequantizerConfig.from_params(**({"lam": 0.0, "background": False} | kw))


def _version(cfg: DequantizerConfig, layout: BlockLayout, train, held, epochs: int = 1, seed: int = 0) -> Version:
    net = build_network(cfg, seed)
    if epochs:
        train_network(net, cfg, layout, train, None, seed=seed, epochs=epochs)
    v = Version(1, 1, cfg, net, make_tables(net, cfg))
    v.heldout = heldout_l1(v, layout, held)
    return v


@pytest.mark.parametrize("params", [{"ladder": "fleet"}, {"ladder": "paper"}, {"ladder": "paper", "residual": "literal"},
                                    {"block": "paper", "kernel": 3, "ladder": (8, 32)}])
def test_identity_at_initialization(params) -> None:
    """The residual branch starts at 0: a fresh network returns its input to within 1e-3
    (the default form exactly; eq. 18 as printed within 2e-5 per step), on grid weights
    of every rung."""
    cfg = _cfg(**params)
    net = build_network(cfg, seed=3)
    rng = np.random.default_rng(0)
    w = rng.uniform(-0.5, 0.5, (2, *cfg.block)).astype(np.float32)
    for j, bits in enumerate(cfg.ladder[:-1]):
        x = torch.from_numpy(quantize(w, bits))
        with torch.no_grad():
            assert float((net(x, j) - x).abs().max()) < 1e-4
            assert float((net.step(x, j) - x).abs().max()) < 2e-5
            if cfg.residual == "deviation":
                assert torch.equal(net(x, j), x)


def test_one_epoch_lowers_heldout_l1_on_trained_digits_weights(digits_weights) -> None:
    """Trained on three digits_cnn models' blocks (ternary inputs, the paper's first rung),
    one epoch lowers the held-out model's L1 to its true weights (all layers, per weight)
    below the fresh network's, which is plain dequantization (0.5·ternary(W))."""
    cfg = _cfg(ladder=(2, 32), lr=0.1, block=(2, 4, 4))
    layout = BlockLayout(DIGITS.param_shapes(), cfg.block)
    train, held = digits_weights[:3], digits_weights[3:]
    sizes = layout.sizes

    def total(v: Version, which: int) -> float:
        return sum(v.heldout[(i, 2)][which] * n for i, n in enumerate(sizes))

    before = _version(cfg, layout, train, held, epochs=0)
    after = _version(cfg, layout, train, held, epochs=1)
    assert total(before, 1) == pytest.approx(total(before, 0), rel=1e-6)  # the identity
    assert total(after, 1) < 0.995 * total(before, 1), total(after, 1) / total(before, 1)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_blocks_round_trip_for_every_model_spec(name: str) -> None:
    """Generic blocks and the paper's modules: cutting every layer and pasting it back
    gives it back; every weight sits in exactly one block position; the paper's cut takes
    vgg7_small's 64x64x3x3 conv6 as one module (one output filter per channel)."""
    spec = get_spec(name)
    weights = init_shared(spec, 1)
    for block, modules in (((2, 16, 16), False), ((64, 24, 24), True), ((4, 8, 8), False)):
        layout = BlockLayout(spec.param_shapes(), block, modules)
        blocks, layers, ks = layout.cut_model(weights)
        assert len(blocks) == len(layers) == len(ks) == layout.n_blocks
        assert sum(layout.mask(i).sum() for i in range(len(weights))) == spec.param_count
        index = layout.model_index(layers, ks)
        flat = np.concatenate([w.reshape(-1) for w in weights])
        np.testing.assert_array_equal(blocks.reshape(len(blocks), -1)[index >= 0], flat[index[index >= 0]])
        real = index[index >= 0]
        assert real.size == spec.param_count and np.array_equal(np.sort(real), np.arange(spec.param_count))
        for i, w in enumerate(weights):
            blocks = layout.cut(i, w.reshape(-1))
            assert blocks.shape == (layout.counts[i], *block)
            np.testing.assert_array_equal(layout.paste(i, blocks).reshape(w.shape), w)
    if name == "vgg7_small":
        layout = BlockLayout(spec.param_shapes(), (64, 24, 24), modules=True)
        conv6 = spec.param_names().index("conv6")
        assert layout.perms[conv6] is not None and layout.counts[conv6] == 1
        np.testing.assert_array_equal(layout.cut(conv6, weights[conv6].reshape(-1))[0].reshape(64, 576),
                                      weights[conv6].reshape(64, 576))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_dequantizer_keeps_every_spec_update_shape(name: str) -> None:
    """An Int8 update of every model spec comes out of the stage with its layer shapes
    and dtypes, dequantized (every gate on) and finite."""
    spec = get_spec(name)
    cfg = _cfg(ladder=(8, 32), lr=0.1)
    deq = ProwdDequantizer(background=False, ladder=(8, 32), lam=0.0)
    weights = init_shared(spec, 2)
    deq.begin_round(1, weights)
    v = _version(cfg, deq._layout, [], [], epochs=0)
    v.net.steps[0].rho1.alpha.out.bias.data.fill_(0.01)  # a visible, deterministic change
    v.tables = make_tables(v.net, cfg)
    v.gates = {(i, 8): True for i in range(len(weights))}
    deq._version = v
    q = [quantize(w, 8) for w in weights]
    out = deq(ClientUpdate("d", 1, q, "weights", 8))
    for a, b in zip(out.weights, q, strict=True):
        assert a.shape == b.shape and a.dtype == np.float32 and np.all(np.isfinite(a))
        assert not np.array_equal(a, b)


def test_grid_precision_reads_the_entry_rung() -> None:
    rng = np.random.default_rng(0)
    w = rng.uniform(-0.5, 0.5, 1000).astype(np.float32)
    for bits in (2, 4, 6, 8, 12, 16):
        assert grid_precision(quantize(w, bits)) == bits
    assert grid_precision(w) == 0                                  # a float layer: no rung
    assert grid_precision(np.zeros(5, np.float32)) == 1
    assert grid_precision(np.array([0.5, np.nan], np.float32)) == 0
    assert grid_precision(np.array([0.75], np.float32)) == 0       # beyond the clip


def test_tables_equal_the_network(digits_weights) -> None:
    """The lookup-table path (Int6 and Int8 entries) gives the network's outputs."""
    cfg = _cfg(ladder=(6, 8, 32), lr=0.1)
    layout = BlockLayout(DIGITS.param_shapes(), cfg.block)
    v = _version(cfg, layout, digits_weights[:2], [], epochs=1)
    assert sorted(v.tables) == [6, 8]
    for bits in (6, 8):
        for i, w in enumerate(digits_weights[3]):
            x = quantize(w.reshape(-1), bits)
            got = v.dequantize(layout, i, x, bits)
            want = run_direct(v.net, layout, i, x, cfg.ladder.index(bits))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def _run_rounds(strategy, rounds: list[dict], bits: int = 8) -> list[dict]:
    """Feed ``rounds`` (global + float + low-bit models) through ``strategy.accept``."""
    out = []
    for r, rec in enumerate(rounds, 1):
        strategy.begin_round(r, rec["global"])
        for k, w in enumerate(rec["float"]):
            strategy.accept(ClientUpdate(f"f{k}", 50, w, "weights", 32))
        for k, w in enumerate(rec["low"]):
            strategy.accept(ClientUpdate(f"q{k}", 50, [quantize(x, bits) for x in w], "weights", bits, True))
        out.append(strategy.finish().stats)
    return out


def _rounds(digits_weights) -> list[dict]:
    g, a, b, c = digits_weights
    return [{"global": g, "float": [a, b], "low": [c]}, {"global": g, "float": [b, c], "low": [a]},
            {"global": g, "float": [c, a], "low": [b]}]


def test_strategy_trains_applies_and_gates(digits_weights, caplog) -> None:
    """``prowd`` through the strategy: a version is trained after round 1 from the float
    devices' weights and the global model, round 2 uses it; the log and the stats name
    every (layer, entry) verdict, and a gated-off layer passes through unchanged."""
    caplog.set_level(logging.INFO, "fedbit.dequantizer")
    s = build_strategy("prowd", model="digits_cnn", dequantize_params={
        "ladder": (2, 8, 32), "lr": 0.1, "epochs": 1, "background": False, "buffer_size": 8})
    stats = _run_rounds(s, _rounds(digits_weights)[:1], bits=2)
    assert stats[0]["dequantizer_version"] == 0 and stats[0]["dequantizer_fallback"] == 1
    v = s.dequantizer.version
    assert v is not None and v.info["train_models"] == 2 and v.info["heldout_models"] == 1
    assert v.info["distill"] < -0.5  # the distillation term ran (cosine of softmax outputs)
    assert "held-out L1" in caplog.text and ("on" in caplog.text or "off:" in caplog.text)
    # round 2 with the version: Int2 (ternary) updates enter at rung 2, Int8 at rung 8
    s.begin_round(2, digits_weights[0])
    tern = [quantize(x, 2) for x in digits_weights[1]]
    out = s.dequantizer(ClientUpdate("t", 5, tern, "weights", 8))
    for i, (a, b) in enumerate(zip(out.weights, tern, strict=True)):
        assert (a is b) == (not v.is_on(i, 2))
    v.gates = {k: False for k in v.gates}                          # every layer off
    q8 = [quantize(x, 8) for x in digits_weights[1]]
    assert s.dequantizer(ClientUpdate("e", 5, q8, "weights", 8)).weights == q8
    st = s.dequantizer.stats()
    assert st["dequantizer_version"] == v.number
    assert {f"dequantizer_on/{i}/int{b}" for i in range(4) for b in (2, 8)} <= set(st)
    # float, delta and non-grid (K-means-like) updates are never dequantized
    u = ClientUpdate("f", 5, digits_weights[2], "weights", 32)
    assert s.dequantizer(u) is u
    d = ClientUpdate("d", 5, tern, "delta", 8)
    assert s.dequantizer(d) is d


def test_checkpoint_restore_gives_bit_identical_outputs(digits_weights) -> None:
    """The strategy's checkpoint (msgpack, as the coordinator writes it) restores the
    version: the same outputs bit for bit, on the table path (Int8) and the direct path
    (Int16); a dequantizer with another network refuses it."""
    params = {"ladder": (8, 16, 32), "lr": 0.1, "epochs": 1, "background": False, "lam": 0.0}
    s = build_strategy("prowd", model="digits_cnn", dequantize_params=params)
    _run_rounds(s, _rounds(digits_weights)[:1])
    v = s.dequantizer.version
    v.gates = {k: True for k in v.gates}
    state = msgpack.unpackb(msgpack.packb(s.state_dict(), use_bin_type=True), raw=False)
    t = build_strategy("prowd", model="digits_cnn", dequantize_params=params)
    t.load_state_dict(state)
    assert t.dequantizer.version.number == v.number and t.dequantizer.version.gates == v.gates
    for bits in (8, 16):
        q = [quantize(x, bits) for x in digits_weights[3]]
        outs = []
        for strat in (s, t):
            strat.begin_round(5, digits_weights[0])
            outs.append(strat.dequantizer(ClientUpdate("x", 5, q, "weights", bits)).weights)
        for a, b, x in zip(*outs, q, strict=True):
            assert a is not x
            np.testing.assert_array_equal(a, b)
    other = build_strategy("prowd", model="digits_cnn", dequantize_params=params | {"growth": 4})
    with pytest.raises(ConfigError, match="growth"):
        other.load_state_dict(state)


def test_training_failure_falls_back_to_plain(digits_weights, caplog, monkeypatch) -> None:
    """An exception while training (in the background thread) is logged, counted, and
    leaves no version: the stage dequantizes plainly (the updates pass through)."""
    caplog.set_level(logging.ERROR, "fedbit.dequantizer")

    def boom(*_a, **_k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ProwdDequantizer, "train_version", boom)
    s = build_strategy("prowd", model="digits_cnn", dequantize_params={"ladder": (8, 32), "lam": 0.0})
    stats = _run_rounds(s, _rounds(digits_weights)[:1])
    assert s.dequantizer.wait(30)
    stats += _run_rounds(s, _rounds(digits_weights)[1:2])
    assert "injected failure" in caplog.text and "plain dequantization" in caplog.text
    assert stats[1]["dequantizer_failures"] >= 1 and stats[1]["dequantizer_version"] == 0
    assert stats[1]["dequantizer_fallback"] == 1 and stats[1]["dequantizer_updates"] == 0


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        build_strategy("prowd", **{"dequantize.bogus": 1})
    with pytest.raises(ConfigError, match="ladder"):
        build_strategy("prowd", **{"dequantize.ladder": "8,6,32"})
    with pytest.raises(ConfigError, match="block"):
        build_strategy("prowd", **{"dequantize.block": "3x4x4"})
    with pytest.raises(ConfigError, match="modules"):
        DequantizerConfig.from_params(modules=True)
    with pytest.raises(ConfigError, match="unknown model"):
        build_strategy("prowd", model="nope")
    with pytest.raises(ConfigError, match="buffer"):
        ProwdDequantizer(model="digits_cnn", buffer=np.zeros((4, 3, 8, 8), np.float32))
    s = build_strategy("prowd", **{"dequantize.ladder": "paper", "dequantize.epochs": 2, "tau": 0.2})
    assert s.dequantizer.cfg.ladder == (2, 4, 8, 16, 32) and s.dequantizer.cfg.epochs == 2
    assert s.mask.tau == 0.2 and s.name == "prowd"


# --------------------------------------------------------------------------- round loop


class _Dev:
    """A device's 'training': a known shift of the received weights; an integer device
    returns its weights on its 8-bit grid (``int_weights``), as the real IntTrainer."""

    spec, bits, lr, lr_shift = get_spec("mlp"), 8, 1.0, 3  # the Trainer protocol

    def __init__(self, shift: float, integer: bool) -> None:
        self.shift, self.integer, self.w = np.float32(shift), integer, []

    def load_shared(self, weights):
        self.w = [np.clip(np.array(w, np.float32) + self.shift, -0.5, 0.5) for w in weights]

    def train(self, data, **_kw):
        return SimpleNamespace(loss=0.1, steps=1, samples=len(data.y), seconds=0.0)

    def to_shared(self):
        return [w.copy() for w in self.w]

    def int_weights(self):
        return [np.clip(np.rint(w * 128), -64, 64).astype(np.int8) for w in self.w]

    def ternary_weights(self):
        return None

    def evaluate(self, data, batch=256):
        return 0.0, 0.0


def _coordinated_run(tmp: Path, strategy, rounds: int = 3):
    from coordinator.config import ServerConfig
    from coordinator.fleet import InProcessFleet
    from coordinator.server import Coordinator
    from coordinator.state import RunState
    from edge_client.runtime import DeviceConfig, DeviceRuntime

    fleet = InProcessFleet("pw")
    data = SimpleNamespace(x=np.zeros((20, 1, 8, 8), np.float32), y=np.zeros(20, np.int64))
    threads = []
    for dev, bits, trainer, codec, shift in (("f1", 32, "torch", "float32", 0.01), ("f2", 32, "torch", "float32", -0.02),
                                             ("i1", 8, "int", "int", 0.03)):
        cfg = DeviceConfig(dev, bits, trainer, codec, 8 if codec == "int" else 32, job="pw", workdir=tmp / dev)
        rt = DeviceRuntime(cfg, data, fleet.device_connector(dev),
                           trainer_factory=lambda spec, b, seed, s=shift, i=(bits < 32): _Dev(s, i))
        th = threading.Thread(target=rt.run, kwargs={"max_seconds": 60}, daemon=True)
        th.start()
        threads.append(th)
    cfg = ServerConfig(job="pw", model="mlp", rounds=rounds, min_devices=3, round_timeout_s=20, presence_timeout_s=20)
    co = Coordinator(cfg, fleet, strategy, RunState(tmp / "out"), evaluator=None, init_weights=init_shared(get_spec("mlp"), 0))
    hist = co.run()
    for th in threads:
        th.join(10)
    fleet.close()
    return co, hist


def test_training_failure_inside_the_round_loop(tmp_path: Path, monkeypatch) -> None:
    """A coordinator over the in-process fleet (two float32 devices, one Int8 device
    sending its own integers) with ``prowd`` whose training always raises: every round
    completes, the metrics say the stage fell back, and the model equals the one plain
    dequantization (``prowd-swa``, same devices) gives."""
    def boom(*_a, **_k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ProwdDequantizer, "train_version", boom)
    prowd = build_strategy("prowd", model="mlp", dequantize_params={"ladder": (8, 32), "lam": 0.0})
    co, hist = _coordinated_run(tmp_path / "a", prowd)
    assert [h["round"] for h in hist] == [1, 2, 3] and all(h["aggregated"] and h["accepted"] == 3 for h in hist)
    prowd.dequantizer.wait(30)
    last = hist[-1]["stats"]
    assert last["dequantizer_failures"] >= 1 and last["dequantizer_version"] == 0
    assert last["dequantizer_fallback"] == 1
    plain_co, _ = _coordinated_run(tmp_path / "b", build_strategy("prowd-swa"))
    for a, b in zip(co.weights, plain_co.weights, strict=True):  # (fused vs decoded-first sums)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert max(float(np.abs(a - w).max()) for a, w in zip(co.weights, init_shared(get_spec("mlp"), 0), strict=True)) > 0.01


def test_round_loop_trains_uses_and_checkpoints_the_dequantizer(tmp_path: Path) -> None:
    """The same fleet with a working ``prowd`` (distillation on the noise buffer, trained
    after each round): round 1 falls back (no version yet), later rounds use the latest
    version; the checkpoint the coordinator wrote restores that version (as ``--resume``
    does) with bit-identical outputs."""
    from coordinator.state import RunState

    params = {"ladder": (8, 32), "lr": 0.1, "epochs": 1, "background": False, "buffer_size": 8}
    prowd = build_strategy("prowd", model="mlp", dequantize_params=params)
    co, hist = _coordinated_run(tmp_path, prowd)
    stats = [h["stats"] for h in hist]
    assert stats[0]["dequantizer_version"] == 0 and stats[0]["dequantizer_fallback"] == 1
    assert [s["dequantizer_version"] for s in stats[1:]] == [1, 2]
    assert all(s["dequantizer_updates"] + s["dequantizer_passed"] == 1 for s in stats)
    assert {"dequantizer_on/0/int8", "dequantizer_l1_ratio/1/int8"} <= set(stats[2])
    v = prowd.dequantizer.version
    assert v.number == 3 and v.info["distill"] < -0.5
    restored = build_strategy("prowd", model="mlp", dequantize_params=params)
    restored.load_state_dict(RunState(tmp_path / "out").load_checkpoint().strategy_state)
    assert restored.dequantizer.version.number == 3
    v.gates = restored.dequantizer.version.gates = {k: True for k in v.gates}
    q = [quantize(w, 8) for w in co.weights]
    for s in (prowd, restored):
        s.begin_round(4, co.weights)
    a = prowd.dequantizer(ClientUpdate("x", 1, q, "weights", 8)).weights
    b = restored.dequantizer(ClientUpdate("x", 1, q, "weights", 8)).weights
    for x, y, z in zip(a, b, q, strict=True):
        assert x is not z
        np.testing.assert_array_equal(x, y)


def test_close_stops_a_running_training(digits_weights, caplog) -> None:
    """``close`` (also run at interpreter exit: torch still training in a daemon thread
    while the interpreter finalizes can abort the process) ends a background training at
    its next step, keeps the last version, counts no failure and starts no other."""
    import time

    caplog.set_level(logging.INFO, "fedbit.dequantizer")
    s = build_strategy("prowd", model="digits_cnn", dequantize_params={"ladder": (8, 32), "epochs": 10_000})
    _run_rounds(s, _rounds(digits_weights)[:1])
    assert s.dequantizer.training
    t0 = time.monotonic()
    s.dequantizer.close()
    assert time.monotonic() - t0 < 10 and not s.dequantizer.training
    assert s.dequantizer.version is None and s.dequantizer.stats()["dequantizer_failures"] == 0
    assert "stopped" in caplog.text
    _run_rounds(s, _rounds(digits_weights)[1:2])
    assert not s.dequantizer.training


def test_a_diverged_network_passes_layers_through(digits_weights, caplog) -> None:
    """A version whose network gives NaN has no tables (their outputs are checked when
    built) and its direct outputs are checked per layer: the layers pass through unchanged,
    logged, and the update stays finite."""
    caplog.set_level(logging.ERROR, "fedbit.dequantizer")
    cfg = _cfg(ladder=(8, 32))
    deq = ProwdDequantizer(background=False, ladder=(8, 32), lam=0.0)
    deq.begin_round(1, digits_weights[0])
    v = _version(cfg, deq._layout, [], [], epochs=0)
    v.net.steps[0].rho1.alpha.out.bias.data.fill_(float("nan"))
    v.tables = make_tables(v.net, cfg)
    assert v.tables == {}
    v.gates = {(i, 8): True for i in range(4)}
    deq._version = v
    q = [quantize(w, 8) for w in digits_weights[1]]
    out = deq(ClientUpdate("d", 1, q, "weights", 8))
    assert out.weights == q and "non-finite" in caplog.text
    assert deq.stats()["dequantizer_layers_off"] == 4


def test_a_background_version_comes_into_use_on_a_fixed_schedule(digits_weights) -> None:
    """With ``train_every = 2`` the version trained in the background after round 1 is put
    in use at the end of round 3 (waited for there), and the next training starts then: the
    round a version is applied in is fixed by the round number, not by the training's speed."""
    s = build_strategy("prowd", model="digits_cnn", dequantize_params={
        "ladder": (8, 32), "lr": 0.1, "epochs": 1, "lam": 0.0, "train_every": 2})
    rounds = _rounds(digits_weights)
    stats = _run_rounds(s, rounds + rounds[:2])
    assert [st["dequantizer_version"] for st in stats] == [0, 0, 0, 1, 1]
    assert [st["dequantizer_training"] for st in stats] == [0, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match="train_every"):
        build_strategy("prowd", dequantize_params={"train_every": 0})
