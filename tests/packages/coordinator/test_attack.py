"""Emulated attackers (the emulator's ``[attack]`` section): the settings are checked, each
kind rewrites an update as documented, and one x100 device beside an honest fleet goes
through the real broker and the real coordinator, is bounded, quarantined within three
rounds, and the Int8 group keeps its accuracy under the default defense."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.emulation.attack import AttackConfig, attack_update, flip_labels
from coordinator.emulation.config import from_dict
from coordinator.emulation.emulator import Emulator
from edge_client.codecs import encode
from edge_client.errors import ConfigError
from edge_client.protocol import Update, decode_message, encode_message, float32_tensor

G = [np.full((3, 2), 0.5, np.float32), np.full(4, -1.0, np.float32)]
X = [np.full((3, 2), 0.75, np.float32), np.full(4, -0.5, np.float32)]


def weights(payload: bytes) -> tuple[Update, list[np.ndarray]]:
    from coordinator.strategies.decode import decode_update
    from coordinator.strategies.types import EncodedUpdate

    u = decode_message(payload)
    return u, decode_update(EncodedUpdate(u.device_id, u.num_samples, u.tensors, u.content, u.compute_bits)).weights


def test_attack_settings_are_checked() -> None:
    from coordinator.emulation.config import from_dict

    assert not AttackConfig().active and AttackConfig(fraction=0.1).active
    base = {"devices": {"raspberry-pi-4": 2}}
    for bad, why in (({"devices": ["a"], "fraction": 0.5}, "not both"), ({"kind": "krum"}, "kind"),
                     ({"factor": float("inf")}, "factor"), ({"from_round": 0}, "from_round"),
                     ({"devices": ["bad id"]}, "devices"), ({"fraction": 2}, "fraction"), ({"nope": 1}, "unknown"),
                     ({"kind": "noise", "factor": -1.0}, "factor")):
        with pytest.raises(ConfigError, match=f"x.toml: attack.*{why}"):
            from_dict(base | {"attack": bad}, "x.toml")
    assert from_dict(base | {"attack": {"kind": "scale", "factor": -100.0}}, "x").attack.factor == -100.0
    plan = SimpleNamespace(locate=lambda d: {"pi-0": 0, "pi-1": 1}[d], device_id=lambda i: f"pi-{i}")
    with pytest.raises(ConfigError, match="not a device of the fleet"):
        AttackConfig(devices=["pi-7"]).attackers(plan, 0)
    assert AttackConfig(devices=["pi-1"]).attackers(plan, 0) == {"pi-1"}


def test_each_kind_rewrites_the_update_as_documented() -> None:
    honest = encode_message(Update("d", 3, 40, 8, "weights", tuple(encode(w, "asym", 8) for w in X)))
    u, x = weights(honest)
    scaled = weights(attack_update(AttackConfig(kind="scale", factor=100), honest, G, 0))[1]
    boosted = weights(attack_update(AttackConfig(kind="boost", factor=10), honest, G, 0))[1]
    noisy = weights(attack_update(AttackConfig(kind="noise", factor=2), honest, G, 0))[1]
    for a, b, c, xx, g in zip(scaled, boosted, noisy, x, G, strict=True):
        np.testing.assert_allclose(a, 100 * xx, rtol=1e-6)
        np.testing.assert_allclose(b, g + 10 * (xx - g), rtol=1e-5)
        assert not np.allclose(c, xx)
    step = np.sqrt(np.mean(np.concatenate([(xx - g).ravel() ** 2 for xx, g in zip(x, G, strict=True)])))
    noise = np.concatenate([(c - xx).ravel() for c, xx in zip(noisy, x, strict=True)])
    assert 0.5 * step < noise.std() < 4 * step                              # factor 2 x the honest step
    out = decode_message(attack_update(AttackConfig(kind="samples", factor=1000), honest, G, 0))
    assert out.num_samples == 40_000 and out.tensors == u.tensors           # the update itself honest
    same = attack_update(AttackConfig(kind="label_flip"), honest, G, 0)
    assert same == honest and flip_labels(np.array([0, 3, 9]), 10).tolist() == [9, 6, 0]
    # a delta update stays a delta: (factor * (g + d)) - g
    delta = encode_message(Update("d", 3, 40, 32, "delta", tuple(float32_tensor(xx - g) for xx, g in zip(X, G,
                                                                                                         strict=True))))
    d_out, d = weights(attack_update(AttackConfig(kind="scale", factor=3), delta, G, 0))
    assert d_out.content == "delta" and d_out.round_id == 3 and d_out.compute_bits == 32
    for a, xx, g in zip(d, X, G, strict=True):
        np.testing.assert_allclose(a, 3 * xx - g, rtol=1e-6)


CLOCK = {"seconds_per_sample": {"float32": 2e-3, "int8": 1e-2}}


@pytest.mark.mosquitto
def test_a_x100_device_beside_an_honest_fleet_is_quarantined_and_the_int8_group_holds(tmp_path: Path) -> None:
    def run(attack: dict | None) -> list[dict]:
        raw = {"name": "atk", "model": "mlp", "rounds": 6, "strategy": "fedavg", "transport": "mqtt",
               "devices": {"raspberry-pi-4": 2, "desktop": 1}, "data": {"partition": "iid"},
               "train": {"epochs": 2, "batch": 32}, "round": {"workers": 1}, "clock": CLOCK}
        if attack:
            raw["attack"] = attack
        return Emulator(from_dict(raw, "test"), 0, tmp_path / ("attacked" if attack else "clean")).run().history

    def int8(hist: list[dict]) -> float:  # (the last three rounds: one round's figure is noisy)
        return float(np.mean([h["groups"]["int8"]["accuracy"] for h in hist[-3:]]))

    clean = run(None)
    hist = run({"devices": ["desktop-0"], "kind": "scale", "factor": 100.0, "from_round": 2})
    assert not hist[0]["defense"]["struck"]                                   # honest in round 1
    for h in hist[1:4]:                                                       # bounded each round it attacks
        assert "desktop-0" in h["accepted_ids"] and float(h["defense"]["struck"]["desktop-0"].split()[2][:-1]) > 100
    assert hist[3]["defense"]["newly_quarantined"] == ["desktop-0"]           # within three rounds
    assert all("desktop-0" not in h["selected_ids"] for h in hist[4:])
    assert int8(hist) >= int8(clean) - 0.03, (int8(hist), int8(clean))


@pytest.mark.parametrize("blame", [True, False], ids=["blamed", "whole-round"])
def test_an_undefended_collapse_rolled_back_between_test_scorings_keeps_the_run_going(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blame: bool) -> None:
    """Without the defense a x100 device collapses the model and each such round is rolled
    back; with a validation split the test split is scored in the reported rounds only, so
    a rolled-back earlier round has no test figure (NaN, then null in metrics.jsonl): the
    run goes on to its last round, every line strict JSON, and a reported round that is
    rolled back scores the model it keeps on the test split."""
    raw = {"name": "undefended", "model": "digits_cnn", "rounds": 16, "strategy": "fedavg", "transport": "inproc",
           "devices": {"raspberry-pi-4": 3, "desktop": 1}, "data": {"partition": "iid", "validation": 0.1},
           "train": {"epochs": 1, "batch": 32}, "clock": CLOCK,
           "defense": {"norm_bound": 0, "sample_bound": 0, "strikes": 0},
           "attack": {"devices": ["desktop-0"], "kind": "scale", "factor": 100.0, "from_round": 2}}
    if not blame:  # no aggregate without some updates is tried: the whole round rolled back
        monkeypatch.setattr("coordinator.defense.recover.suspects", lambda *a, **k: iter(()))
    run = Emulator(from_dict(raw, "test"), 0, tmp_path / "run").run()
    assert [h["round"] for h in run.history] == list(range(1, 17))
    rolled = [h for h in run.history if h["health"]["rolled_back"]]
    assert rolled, "the x100 update never collapsed the model: the test exercises nothing"
    lines = (tmp_path / "run" / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 16 and all("NaN" not in x for x in lines)
    assert any(None in json.loads(x)["health"].get("rolled_back_accuracy", {}).values() for x in lines)
    # a round rolled back among the reported ones is scored on the test split as they are
    assert any(h["health"]["rolled_back"] for h in run.history[-5:])
    assert all(h["groups"][g]["accuracy"] is not None for h in run.history[-5:] for g in ("int8", "float32"))
