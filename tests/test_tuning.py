"""Every arm tuned, equally: a bracket per method with one budget, chosen on tuning seeds'
validation figures, the reported seeds fresh, the choices in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.emulation.config import from_dict
from coordinator.emulation.sweep import run_experiment
from coordinator.emulation.tuning import bracket
from edge_client.errors import ConfigError

CLOCK = {"seconds_per_sample": {"float32": 1e-4}}
TUNE = {"seeds": [7], "by": "method", "FedAvg": {"train.lr": [0.001, 0.5]},
        "FedAvg SGD": {"train.lr": [0.3], "train.momentum": [0.0, 0.9]}}


def raw(tune: dict | None = None, **over) -> dict:
    base = {"name": "tu", "model": "digits_cnn", "rounds": 1, "seeds": [0], "strategy": "fedavg",
            "devices": {"desktop": 2}, "data": {"partition": "iid", "validation": 0.2},
            "train": {"steps": 4, "batch": 16}, "round": {"workers": 1}, "clock": CLOCK,
            "sweep": {"baseline": "FedAvg", "tune": TUNE if tune is None else tune,
                      "@method": [{"label": "FedAvg", "strategy": "fedavg"},
                                  {"label": "FedAvg SGD", "strategy": "fedavg", "train.grad_clip": 2.0}]}}
    return base | over


@pytest.mark.parametrize("tune, culprit", [
    (TUNE | {"seeds": [0, 7]}, r"\[0\] are reported seeds too"),
    (TUNE | {"FedAvg": {"train.lr": [0.1, 0.3, 1.0]}}, "budgets differ"),
    ({"seeds": [7], "by": "method", "FedAvg": {"train.lr": [0.1]}}, r"no bracket for \['FedAvg SGD'\]"),
    (TUNE | {"FedProx": {"train.lr": [0.1, 1]}}, "sweep.tune.FedProx: not a value"),
    (TUNE | {"by": "nope"}, "sweep.tune.by"),
])
def test_a_bad_tune_table_is_named(tune: dict, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        from_dict(raw(tune), "t")
    with pytest.raises(ConfigError, match="tuning chooses on the validation split"):
        from_dict(raw(data={"partition": "iid"}), "t")


def test_each_method_is_tuned_on_its_own_seeds_and_reported_on_fresh_ones(tmp_path: Path) -> None:
    cfg = from_dict(raw(), "t")
    assert [len(bracket(TUNE, {"method": m})) for m in ("FedAvg", "FedAvg SGD")] == [2, 2]
    summary = run_experiment(cfg, tmp_path, echo=lambda _m: None).read_text()
    t = json.loads((tmp_path / "tuning.json").read_text())
    assert t["seeds"] == [7] and set(t["combinations"]) == {"method=FedAvg", "method=FedAvg SGD"}
    for label, c in t["combinations"].items():
        assert c["budget"] == 2 and len(c["scores"]) == 2
        best = max(c["scores"], key=c["scores"].get)
        assert best == ", ".join(f"{k}={v}" for k, v in c["chosen"].items()), label
        assert all((tmp_path / "tuning" / f"method-{label.split('=')[1].replace(' ', '-')}").iterdir())
    # the reported runs: the chosen settings, the reported seed only
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["combination"]["method"], r["seed"]) for r in results) == [("FedAvg", 0), ("FedAvg SGD", 0)]
    for r in results:
        info = json.loads((tmp_path / r["run"] / "emulation.json").read_text())
        chosen = t["combinations"][f"method={r['combination']['method']}"]["chosen"]
        assert {k: info["config"]["train"][k.split(".")[1]] for k in chosen} == chosen
    assert "Tuned on seeds [7]" in summary and "train.lr, train.momentum" in summary
