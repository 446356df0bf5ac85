"""Every experiment config loads, expands into valid combinations and, in its quick form
(digits, 2 rounds, every method once), runs end to end through the sweep report with its
statistics: what `make experiments` would run, in seconds."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

from coordinator.emulation.config import expand_sweep, load_config
from coordinator.emulation.experiment import run_experiment
from coordinator.emulation.sections import ClockSettings

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "experiments").glob("*.toml"))
#: the configs run end to end in their quick form: a part that ``extends`` another changes
#: its name and sweep values (a split, a mix) and at most its length, stopping rule and
#: tuning table, whose machinery its base's quick run, the first test here (every
#: combination of every config validated), tests/packages/coordinator/test_stopping.py and test_tuning.py cover
WHOLE = [p for p in CONFIGS if "\nextends = " not in "\n" + p.read_text()]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "experiments" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_config_and_combination_is_valid_with_five_seeds_on_fashion_mnist() -> None:
    names = [p.stem for p in CONFIGS]
    for twin in ("fedshift-table1", "prowd-table2", "prowd-ablation", "fedfor", "mixed-fleet"):
        assert f"fmnist-{twin}" in names
    for path in CONFIGS:
        cfg = load_config(path)
        combos = expand_sweep(cfg)  # every combination validated
        assert combos and all(c.sweep.keys() <= {"baseline", "tune"} for _, c in combos)
        if path.stem.startswith("fmnist-"):
            assert cfg.data.dataset == "fashion-mnist" and cfg.data.validation > 0
            assert len(cfg.seeds) >= 5 and cfg.sweep.get("baseline"), path.name
            assert "Kept" in path.read_text() or "Not a paper" in path.read_text(), path.name
    for part in sorted(set(CONFIGS) - set(WHOLE)):  # a part's quick run is its base's
        base = (part.parent / tomllib.loads(part.read_text())["extends"]).resolve()
        assert base in {p.resolve() for p in WHOLE}, part.name


@pytest.mark.slow
@pytest.mark.parametrize("path", WHOLE, ids=[p.stem for p in WHOLE])
def test_the_quick_form_runs_end_to_end(path: Path, tmp_path: Path) -> None:
    run_all = _run_all()
    fmnist = path.stem.startswith("fmnist-")
    cfg = run_all.quick_config(load_config(path), every_method=fmnist)
    cfg.clock = ClockSettings(dict.fromkeys(run_all.VARIANTS, 1e-4))
    if not fmnist:  # a digits config's machinery is its fmnist twin's: its first combination, twice
        cfg.sweep = {k: (v[:1] if isinstance(v, list) else v) for k, v in cfg.sweep.items()}
        cfg.seeds = [0, 1]
    assert cfg.data.dataset == "digits" and cfg.rounds == 2 and cfg.model in ("digits_cnn", "mlp")
    summary = run_experiment(cfg, tmp_path / "out", echo=lambda _m: None)
    text = summary.read_text()
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert all(r["rounds"] == 2 and r["rounds_averaged"] == 2 for r in results)
    assert "the last 5" not in text and "all 2 rounds" in text
    analysis = json.loads((tmp_path / "out" / "analysis.json").read_text())
    if fmnist:
        methods = {str(r["combination"].get("method", r["combination"].get("strategy"))) for r in results}
        assert len(methods) >= 2 and "Paired differences to the baseline" in text
        assert analysis["paired"] and all(c["rows"] for c in analysis["paired"])
        assert "Validation split" in text
    if isinstance(cfg.sweep.get("tune"), dict):  # a bracket per method, on tuning seeds
        tuning = json.loads((tmp_path / "out" / "tuning.json").read_text())
        assert "Tuned on seeds" in text
        assert len(tuning["combinations"]) == len({json.dumps(r["combination"]) for r in results})
    elif cfg.sweep.get("tune"):
        assert "chosen on the validation split" in text and analysis["chosen"]


def test_the_cifar10_configs_need_only_the_users_folder(tmp_path: Path) -> None:
    from edge_client.errors import ConfigError

    _write_cifar(tmp_path / "cifar")
    paths = sorted((ROOT / "experiments" / "cifar10").glob("*.toml"))
    assert len(paths) >= 5
    for path in paths:
        with pytest.raises(ConfigError, match="data.path"):
            load_config(path)
        cfg = load_config(path, {"data.path": str(tmp_path / "cifar")})
        twin = load_config(ROOT / "experiments" / f"{path.stem.replace('cifar10-', 'fmnist-')}.toml")
        assert cfg.data.dataset == "cifar10" and cfg.sweep == twin.sweep and cfg.seeds == twin.seeds
        assert cfg.stop == twin.stop and expand_sweep(cfg)


def _write_cifar(folder: Path, per_batch: int = 16, test: int = 20) -> None:
    """A small CIFAR-10 folder in the python-batch layout (random pixels, balanced labels)."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for name, n in [*((f"data_batch_{i}", per_batch) for i in range(1, 6)), ("test_batch", test)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": [i % 10 for i in range(n)]}
        (folder / name).write_bytes(pickle.dumps(batch))


@pytest.mark.slow
@pytest.mark.parametrize("name, model", [("fmnist-fedshift-table1", "fedshift_cnn"),
                                         ("fmnist-prowd-table2", "vgg7_small")])
def test_the_experiments_run_on_a_cifar10_folder_with_the_papers_models(name: str, model: str,
                                                                        tmp_path: Path) -> None:
    """`--set data.dataset=cifar10 --set data.path=DIR --set model=...`: the same config on a
    user's CIFAR-10 copy with the paper's model (fedshift_cnn with its He init)."""
    run_all = _run_all()
    _write_cifar(tmp_path / "cifar-10-batches-py")
    cfg = load_config(ROOT / "experiments" / f"{name}.toml",
                      {"data.dataset": "cifar10", "data.path": str(tmp_path), "model": model})
    cfg = run_all.quick_config(cfg, every_method=False, keep_data=True)
    cfg.clock = ClockSettings(dict.fromkeys(run_all.VARIANTS, 1e-4))
    cfg.seeds = [0, 1]  # one combination (the baseline's), two seeds: the sweep report's statistics
    cfg.sweep = {k: (v[:1] if isinstance(v, list) else v) for k, v in cfg.sweep.items() if k != "baseline"}
    cfg.train = cfg.train | {"steps": 1, "batch": 10}  # the data and model path, not learning
    summary = run_experiment(cfg, tmp_path / "out", echo=lambda _m: None)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    info = json.loads((tmp_path / "out" / results[0]["run"] / "emulation.json").read_text())
    assert info["dataset"] == "cifar10" and info["test_samples"] == 20 and info["config"]["model"] == model
    assert info["train_samples"] + info["validation_samples"] == 80 and info["validation_samples"] > 0
    assert len(results) == 2 and all(r["rounds"] == 2 for r in results)
    assert "mean ± sample SD [95% CI" in summary.read_text()
