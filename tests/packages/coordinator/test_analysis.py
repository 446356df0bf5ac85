"""The statistics of the sweep reports: sample SD, t-interval, paired differences seed by
seed, a setting chosen on the validation split, labels that say what was averaged, plots
whose legends stay off the data."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from coordinator.emulation.analysis import analyse, averaging_text, check_analysis, rounds_averaged
from coordinator.emulation.plots import group_colour, plot_bytes, plot_run_accuracy, plot_sweep
from coordinator.emulation.report import summarize_run, sweep_lines
from coordinator.emulation.stats import estimate, paired
from edge_client.errors import ConfigError

T_975_2 = 4.302652729911275  # Student's t, 97.5 % quantile, 2 degrees of freedom (tables)


def test_mean_sample_sd_and_the_t_interval() -> None:
    e = estimate([0.7, 0.8, 0.9, math.nan])
    assert e.n == 3 and e.mean == pytest.approx(0.8) and e.sd == pytest.approx(0.1)  # ddof = 1
    assert e.sd > float(np.std([0.7, 0.8, 0.9]))                                   # not np.std's
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert (e.lo, e.hi) == (pytest.approx(0.8 - half), pytest.approx(0.8 + half))
    assert e.text() == "80.0 ± 10.0 [55.2, 104.8]"
    one = estimate([0.5])
    assert one.n == 1 and math.isnan(one.sd) and one.text() == "50.0 (n = 1)"
    assert estimate([]).text() == "n/a"


def test_paired_differences_are_taken_seed_by_seed() -> None:
    a = {0: 0.65, 1: 0.52, 2: 0.70}
    b = {0: 0.60, 1: 0.50, 3: 0.99}               # seed 3 has no partner, seed 2 neither
    p = paired(a, b)
    assert p.seeds == (0, 1) and (p.wins, p.ties, p.losses) == (2, 0, 0)
    assert p.diff.mean == pytest.approx(0.035) and p.diff.sd == pytest.approx(0.0212132, rel=1e-5)
    assert p.text().startswith("+3.5 ± 2.1 [") and p.text().endswith("wins 2/2")
    assert paired({0: 0.5, 1: 0.4}, {0: 0.5, 1: 0.6}).text().endswith("wins 0/2")


def run(method: str, lr: float, seed: int, test: dict, val: dict | None = None) -> tuple:
    groups = {g: {"mean_last": t, **({"val_mean_last": val[g]} if val else {})} for g, t in test.items()}
    return ({"method": method, "train.lr": lr}, seed, {"groups": groups})


SWEEP = {"baseline": "FedAvg", "tune": "train.lr", "@method": [{"label": "FedAvg"}, {"label": "FedFOR"}],
         "train.lr": [0.1, 1.0]}


def test_a_learning_rate_is_chosen_on_validation_and_methods_are_paired_to_the_baseline() -> None:
    runs = []
    for s in range(3):
        # FedAvg: lr 1.0 wins on test but lr 0.1 on validation -> 0.1 is chosen
        runs.append(run("FedAvg", 0.1, s, {"float32": 0.70 + 0.01 * s}, {"float32": 0.80}))
        runs.append(run("FedAvg", 1.0, s, {"float32": 0.90}, {"float32": 0.60}))
        runs.append(run("FedFOR", 0.1, s, {"float32": 0.60}, {"float32": 0.50}))
        runs.append(run("FedFOR", 1.0, s, {"float32": 0.75 + 0.02 * s}, {"float32": 0.85}))
    a = analyse(runs, SWEEP)
    assert {k: v[0] for k, v in a.chosen.items()} == {"method=FedAvg": "0.1", "method=FedFOR": "1.0"}
    assert {sp for *_, sp in a.chosen.values()} == {"val"}
    (c,) = a.comparisons
    d = c.diffs["method=FedFOR"]["float32"]   # FedFOR@1.0 - FedAvg@0.1, seed by seed
    assert c.partner["method=FedFOR"] == "method=FedAvg"
    assert d.diff.mean == pytest.approx(0.06) and d.wins == 3 and d.diff.sd == pytest.approx(0.01)
    text = "\n".join(sweep_lines(a, averaging_text({(5, 30)}), len(runs)))
    assert "chosen on the validation split" in text and "the last 5 of 30 rounds" in text
    assert "| method=FedFOR | method=FedAvg | +6.0 ± 1.0 [" in text and "wins 3/3" in text
    # the test split never chooses: without validation figures nothing is tuned, every row reported
    no_val = analyse([(c, s, {"groups": {g: {"mean_last": v["mean_last"]} for g, v in r["groups"].items()}})
                      for c, s, r in runs], SWEEP)
    assert not no_val.chosen and no_val.tune is None and len(no_val.reported) == 4
    # and the choice does not move when every test figure does
    poisoned = analyse([(c, s, {"groups": {g: {**v, "mean_last": 1.0 - v["mean_last"]} for g, v in r["groups"].items()}})
                        for c, s, r in runs], SWEEP)
    assert {k: v[:2] for k, v in poisoned.chosen.items()} == {k: v[:2] for k, v in a.chosen.items()}


@pytest.mark.parametrize("sweep, culprit", [
    ({"baseline": "FedProx", "@method": [{"label": "FedAvg"}]}, "sweep.baseline: 'FedProx' is a value of no"),
    ({"baseline": "1", "a": [1, 2], "b": [1, 3]}, r"of 2 \(a, b\) dimensions"),
    ({"baseline": "a=5", "a": [1, 2]}, "no dimension 'a' with value '5'"),
    ({"tune": "train.lr", "a": [1, 2]}, "sweep.tune: 'train.lr' is not one of"),
    ({"tune": "a", "a": [1]}, "single value"),
    ({"tune": "a", "baseline": "1", "a": [1, 2]}, "cannot hold the baseline"),
    ({"baseline": ["a=1", 3], "a": [1, 2]}, "a string or a list of strings"),
])
def test_bad_analysis_keys_are_named(sweep: dict, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        check_analysis(sweep)
    check_analysis({"baseline": "a=1", "tune": "b", "a": [1, 2], "b": [3, 4]})


def test_labels_say_how_many_rounds_were_averaged() -> None:
    assert rounds_averaged(2) == 2 and rounds_averaged(30) == 5 and rounds_averaged(1) == 1
    assert averaging_text({(2, 2)}) == "all 2 rounds" and averaging_text({(1, 1)}) == "the final round"
    records = [{"round": r, "groups": {"int8": {"accuracy": a, "val_accuracy": a + 0.1}}}
               for r, a in ((1, 0.2), (2, 0.4))]
    s = summarize_run({}, records)
    assert s["rounds_averaged"] == 2 and s["groups"]["int8"]["mean_last"] == pytest.approx(0.3)
    assert s["groups"]["int8"]["val_mean_last"] == pytest.approx(0.4)


def test_plots_keep_legends_off_the_data_with_fixed_colours(tmp_path: Path) -> None:
    records = [{"round": r, "sim_time": 2.0 * r, "uplink_bytes": {"float32-32": 900, "kmeans-4": 100 * r},
                "groups": {"float32": {"accuracy": 0.1 * r}, "int8": {"accuracy": 0.09 * r}}} for r in range(1, 8)]
    curves = {"float32": [0.1 * r for r in range(1, 8)], "int8": [0.09 * r for r in range(1, 8)]}
    assert plot_run_accuracy(tmp_path / "a.png", records, curves, "t", 5, "the last 5 of 7 rounds")
    assert plot_bytes(tmp_path / "b.png", records)
    runs = {f"method=M{i}": [curves, {g: [v + 0.01 for v in c] for g, c in curves.items()}] for i in range(12)}
    assert plot_sweep(tmp_path / "c.png", runs, ["float32", "int8"], {}, "the last 5 of 7 rounds")
    assert all((tmp_path / f).stat().st_size > 5000 for f in ("a.png", "b.png", "c.png"))
    assert group_colour("float32") != group_colour("int8") and group_colour("int8") == group_colour("int8")


def test_several_baselines_give_one_comparison_each() -> None:
    runs = [({"strategy": st, "uplink": up}, s, {"groups": {"float32": {"mean_last": acc + 0.01 * s}}})
            for s in range(3) for st, up, acc in (("fedavg", "32+32", 0.80), ("fedavg", "asym-4", 0.70),
                                                   ("fedshift", "32+32", 0.80), ("fedshift", "asym-4", 0.75))]
    a = analyse(runs, {"baseline": ["fedavg", "uplink=32+32"], "strategy": ["fedavg", "fedshift"],
                       "uplink": ["32+32", "asym-4"]})
    by_strategy, by_uplink = a.comparisons
    assert by_strategy.baseline == ("strategy", "fedavg") and by_uplink.baseline == ("uplink", "32+32")
    assert by_strategy.diffs["strategy=fedshift, uplink=asym-4"]["float32"].diff.mean == pytest.approx(0.05)
    assert by_uplink.diffs["strategy=fedavg, uplink=asym-4"]["float32"].diff.mean == pytest.approx(-0.10)
    assert by_uplink.diffs["strategy=fedavg, uplink=asym-4"]["float32"].losses == 3
