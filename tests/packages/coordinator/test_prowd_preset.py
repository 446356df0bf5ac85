"""``paper = "prowd"``: ProWD where the paper puts it. Integer devices send ternary weights,
float devices train with Weight Normalization, the strategy is ProWD in full with the
paper's ladder, conv-slice blocks and SWA reading; a baseline of the paper (FedAvg,
FedGroupedAvg) runs the same devices without ProWD's stages; a short run on the emulator
does all of it for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.emulation.config import expand_sweep, from_dict
from coordinator.emulation.emulator import Emulator
from coordinator.strategies import build_strategy, strategy_stages
from edge_client.errors import ConfigError

CLOCK = {"seconds_per_sample": {"float32": 1e-4, "int8": 2e-5}}


def raw(**over) -> dict:
    base = {"name": "p", "paper": "prowd", "model": "digits_cnn", "rounds": 3, "transport": "inproc",
            "devices": {"raspberry-pi-4": 2, "desktop": 2}, "data": {"partition": "iid"},
            "train": {"steps": 12, "batch": 32}, "clock": CLOCK}
    return base | over


def test_the_preset_sets_uplinks_wn_and_the_stages_it_has() -> None:
    cfg = from_dict(raw(), "t")
    assert cfg.strategy == "prowd" and cfg.codecs == {"raspberry-pi-4": "ternary"}
    assert cfg.train["wn"] is True and cfg.train["steps"] == 12 and cfg.strategy_params == {"weighted": False}
    stages = cfg.paper_stage_params
    assert stages["swa.tau_mode"] == "keep" and stages["dequantize.block"] == "slices"
    assert stages["dequantize.kernel"] == 3 and stages["dequantize.ladder"] == "paper"
    strat = build_strategy(cfg.strategy, model=cfg.model, **cfg.build_params())
    assert strat.mask.tau_mode == "keep" and strat.dequantizer.cfg.slices
    assert strat.dequantizer.cfg.ladder == (2, 4, 8, 16, 32) and strat.dequantizer.cfg.context == "global"
    # the paper's baselines: the same devices, no stage settings they have no stage for
    assert from_dict(raw(strategy="fedavg"), "t").paper_stage_params == {}
    assert set(from_dict(raw(strategy="prowd-swa"), "t").paper_stage_params) == {"swa.tau", "swa.tau_mode"}
    deq = from_dict(raw(strategy="fedavg", strategy_params={"dequantize": "prowd"}), "t").paper_stage_params
    assert deq and all(k.startswith("dequantize.") for k in deq)
    # the config's own settings win
    own = from_dict(raw(strategy_params={"tau_mode": "drop"}, codecs={"raspberry-pi-4": "int-8"}), "t")
    assert "swa.tau_mode" not in own.paper_stage_params and own.codecs == {"raspberry-pi-4": "int-8"}
    assert build_strategy(own.strategy, **own.build_params()).mask.tau_mode == "drop"
    # a sweep over methods: each combination gets the stage settings its method has
    combos = expand_sweep(from_dict(raw(sweep={"strategy": ["fedavg", "prowd"]}), "t"))
    assert [c.paper_stage_params != {} for _, c in combos] == [False, True]


def test_stage_settings_need_their_stage() -> None:
    assert strategy_stages("prowd") == {"swa", "dequantize"}
    assert strategy_stages("fedavg", {"dequantize": "prowd"}) == {"dequantize"}
    assert strategy_stages("prowd-swa+fedshift") == {"swa"} and strategy_stages("grouped") == frozenset()
    assert build_strategy("prowd-swa", **{"swa.tau_mode": "keep", "swa.tau": 0.2}).mask.tau == 0.2
    with pytest.raises(ConfigError, match="swa.tau_mode"):
        build_strategy("fedavg", **{"swa.tau_mode": "keep"})
    with pytest.raises(ConfigError, match="tau_mode"):
        build_strategy("prowd-swa", tau_mode="most")


def test_a_short_preset_run_uses_ternary_uplinks_and_logs_every_stage(tmp_path: Path) -> None:
    """Three rounds of the preset on digits (2 Int8 + 2 float32 devices): the Int8 devices'
    uplink is ternary, every round logs SWA's masked fraction per layer and group (keep
    mode: about 90 % of the Int8 elements left out) and the dequantizer's state, a version
    is trained and judged per layer, and every group's model learns."""
    cfg = from_dict(raw(strategy_params={"dequantize.epochs": 1, "dequantize.background": False}), "t")
    res = Emulator(cfg, 0, tmp_path / "run").run()
    hist = res.history
    assert all(h["aggregated"] for h in hist)
    assert set(hist[-1]["uplink_bytes"]) == {"ternary-2", "float32-32"}
    for h in hist:
        st = h["stats"]
        for layer in range(4):
            assert 0.85 <= st[f"masked_fraction/{layer}/int8"] <= 0.95 and st[f"masked_fraction/{layer}/float32"] == 0
        assert "dequantizer_version" in st
    last = hist[-1]["stats"]
    assert last["dequantizer_version"] >= 1 and any(k.startswith("dequantizer_on/") for k in last)
    assert any(k.startswith("dequantizer_l1_ratio/2/int2") for k in last)
    info = json.loads((tmp_path / "run" / "emulation.json").read_text())
    assert info["paper_stage_params"]["dequantize.context"] == "global"
    assert {d["codec"] for d in info["devices"] if d["variant"] == "int8"} == {"ternary-2"}
    for g in ("int8", "float32"):
        assert max(h["groups"][g]["accuracy"] for h in hist) > 0.3, g  # chance: 0.1


def test_a_preset_run_repeats_exactly_however_long_the_background_training_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dequantizer trains on a background thread (the default) while the next round
    runs, and the version trained after round r is applied from round r + 2, waited for if
    need be: two runs of one seed, the second with every training slowed down by 0.3 s,
    give the same run, every group's accuracy and every stage's figure in every round (a
    version is trained and applied within the three rounds)."""
    import time

    from coordinator.strategies.prowd_dequantizer.stage import ProwdDequantizer

    params = {"dequantize.epochs": 1}
    runs = [Emulator(from_dict(raw(strategy_params=params, rounds=3), "t"), 0, tmp_path / "run0").run().history]
    train = ProwdDequantizer.train_version

    def slow(self, *a, **k):
        time.sleep(0.3)
        return train(self, *a, **k)

    monkeypatch.setattr(ProwdDequantizer, "train_version", slow)
    runs.append(Emulator(from_dict(raw(strategy_params=params, rounds=3), "t"), 0, tmp_path / "run1").run().history)
    assert runs[1][-1]["stats"]["dequantizer_version"] >= 1
    assert any(v == 1 for k, v in runs[1][-1]["stats"].items() if k.startswith("dequantizer_on/"))
    assert runs[1][-1]["stats"]["dequantizer_updates"] >= 1  # a version was applied
    for a, b in zip(runs[0], runs[1], strict=True):
        assert a["groups"] == b["groups"], a["round"]
        figures = lambda h: {k: v for k, v in h["stats"].items() if "seconds" not in k and not k.endswith("_s")}  # noqa: E731
        assert figures(a) == figures(b), a["round"]
