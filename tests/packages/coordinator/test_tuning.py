"""Every arm tuned, equally: a bracket per method with one budget, chosen on tuning seeds'
validation figures, the reported seeds fresh, the choices in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.emulation.config import expand_sweep, from_dict
from coordinator.emulation.experiment import _tune
from coordinator.emulation.report import tuning_lines
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
    """The tuning phase of a sweep (its reported runs and report: the quick forms of
    fmnist-fedfor-local and fmnist-fedwsq, tests/system/test_experiments_quick.py)."""
    cfg = from_dict(raw(), "t")
    assert [len(bracket(TUNE, {"method": m})) for m in ("FedAvg", "FedAvg SGD")] == [2, 2]
    combos = _tune(cfg, expand_sweep(cfg), tmp_path, on_event=None, echo=lambda _m: None, on_run=None, resume=False)
    t = json.loads((tmp_path / "tuning.json").read_text())
    assert t["seeds"] == [7] and set(t["combinations"]) == {"method=FedAvg", "method=FedAvg SGD"}
    for (combo, c), (label, choice) in zip(combos, t["combinations"].items(), strict=True):
        assert choice["budget"] == 2 and len(choice["scores"]) == 2
        best = max(choice["scores"], key=choice["scores"].get)
        assert best == ", ".join(f"{k}={v}" for k, v in choice["chosen"].items()), label
        # the reported runs: the chosen settings, the reported seeds only
        assert c.seeds == [0] and {k: c.train[k.split(".")[1]] for k in choice["chosen"]} == choice["chosen"]
        runs = list((tmp_path / "tuning").glob(f"method-{combo['method'].replace(' ', '-')}/*/seed-7"))
        assert len(runs) == 2 and all((r / "out" / "metrics.jsonl").is_file() for r in runs)
    text = "\n".join(tuning_lines(t))
    assert "Tuned on seeds [7]" in text and "train.lr, train.momentum" in text
