"""Experiment configs: the bundled default, validation errors that name file and key,
overrides and sweeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.emulation.config import expand_sweep, load_config, parse_codec, run_slug
from edge_client.errors import ConfigError

BASE = """
name = "t"
[devices]
raspberry-pi-4 = 2
desktop = 1
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


def test_the_bundled_default_is_a_mixed_fleet_of_twenty() -> None:
    cfg = load_config()
    assert sum(cfg.devices.values()) == 20 and cfg.transport == "mqtt"
    assert {"raspberry-pi-zero-2w", "raspberry-pi-4", "raspberry-pi-5", "jetson-nano", "jetson-orin-nano",
            "desktop"} <= set(cfg.devices)


@pytest.mark.parametrize("text, key", [
    ("rondos = 3", "rondos"),                                   # unknown top-level key
    ("rounds = 0", "rounds"),
    ("rounds = \"3\"", "rounds"),                              # wrong type
    ("strategy = \"fedfoo\"", "strategy"),
    ("model = \"resnet\"", "model"),
    ("transport = \"zmq\"", "transport"),
    ("seeds = []", "seeds"),
    ("[data]\npartition = \"random\"", "data.partition"),
    ("[data]\nalpha = -1", "data.alpha"),
    ("[data]\ndataset = \"mnist\"", "data.path"),               # no packaged copy: a path is needed
    ("[data]\ndataset = \"imagenet\"", "data.dataset"),
    ("[data]\nvalidation = 1.0", "data.validation"),
    ("[data]\ninferior = [\"jetson-nano\"]", "data.inferior"),     # not in [devices]
    ("[data]\nlabels = 3", "data.labels"),                      # unknown key in a section
    ("[round]\nquorum = 1.5", "round.quorum"),
    ("[round]\ndeadline_s = -1", "round.deadline_s"),
    ("[round]\nparallel = 0", "round.parallel: must be >= 1"),
    ("[round]\nworkers = 1.5", "round.workers: expected int"),
    ("[cluster]\nbackend = \"slurm\"", "cluster.backend: 'slurm' is not 'local' or 'ray'"),
    ("[cluster]\naddress = \"here\"", "cluster.address: 'here'"),
    ("[codecs]\nraspberry-pi-4 = \"kmeans-9\"", "codecs.raspberry-pi-4"),
    ("[codecs]\njetson-nano = \"asym-4\"", "codecs.jetson-nano"),  # not in [devices]
    ("[clock]\nseconds_per_sample = {int8 = 0}", "clock.seconds_per_sample.int8"),
    ("[sweep]\nstrategy = \"fedavg\"", "sweep.strategy"),
])
def test_bad_values_name_the_file_and_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, BASE.replace("[devices]", text + "\n[devices]", 1) if not text.startswith("[")
                 else BASE + text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and key in str(e.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "rounds = = 3"))
    with pytest.raises(ConfigError, match="devices"):
        load_config(write(tmp_path, "rounds = 3"))


def test_overrides_and_sweeps(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + '[sweep]\nstrategy = ["fedavg", "fedshift"]\n"data.partition" = ["iid", "shards"]\n')
    cfg = load_config(path, {"rounds": 7, "round.deadline_s": 3.5, "seeds": [1, 2]})
    assert cfg.rounds == 7 and cfg.round.deadline_s == 3.5 and cfg.seeds == [1, 2]
    runs = expand_sweep(cfg)
    assert [c for c, _ in runs] == [{"strategy": s, "data.partition": p} for s in ("fedavg", "fedshift")
                                    for p in ("iid", "shards")]
    assert all(not c.sweep and c.rounds == 7 for _, c in runs)
    assert runs[3][1].strategy == "fedshift" and runs[3][1].data.partition == "shards"
    assert len({run_slug(c) for c, _ in runs}) == 4
    with pytest.raises(ConfigError, match="sweep"):
        expand_sweep(load_config(write(tmp_path, BASE + '[sweep]\n"data.partition" = ["iid", "nope"]\n')))
    mix = load_config(write(tmp_path, BASE + '[sweep]\n"@mix" = [{label = "a", "devices.desktop" = 3, rounds = 4},'
                                               ' {label = "b", "devices.desktop" = 0}]\n'))
    (ca, a), (cb, b) = expand_sweep(mix)
    assert ca == {"mix": "a"} and a.devices["desktop"] == 3 and a.rounds == 4
    assert cb == {"mix": "b"} and b.devices == {"raspberry-pi-4": 2, "desktop": 0} and b.rounds == 10
    with pytest.raises(ConfigError, match="sweep.@mix"):
        load_config(write(tmp_path, BASE + '[sweep]\n"@mix" = [{"devices.desktop" = 3}]\n'))
    with pytest.raises(ConfigError, match="unknown section"):
        load_config(path, {"nosuch.key": 1})


def test_a_config_extends_another(tmp_path: Path) -> None:
    """``extends``: the base's tables merged key by key under this file's, other values
    replaced (a sweep dimension whole), the path relative to this file; a missing base, a
    non-string and a cycle are errors naming the file."""
    (tmp_path / "parts").mkdir()
    base = tmp_path / "base.toml"
    base.write_text(BASE + '[train]\nsteps = 7\nlr = 0.5\n[sweep]\nbaseline = "fedavg"\n'
                    'strategy = ["fedavg", "fedshift"]\n"@split" = [{label = "a", "data.partition" = "iid"}]\n')
    part = tmp_path / "parts" / "b.toml"
    part.write_text('extends = "../base.toml"\nname = "t-b"\n[devices]\ndesktop = 4\n[train]\nlr = 2.0\n'
                    '[sweep]\n"@split" = [{label = "b", "data.partition" = "shards"}]\n')
    cfg = load_config(part)
    assert cfg.name == "t-b" and cfg.devices == {"raspberry-pi-4": 2, "desktop": 4}
    assert cfg.train["steps"] == 7 and cfg.train["lr"] == 2.0
    combos = [c for c, _ in expand_sweep(cfg)]
    assert combos == [{"strategy": s, "split": "b"} for s in ("fedavg", "fedshift")]
    assert load_config(base).name == "t"  # the base itself is unchanged
    for text, why in (('extends = "nope.toml"', "no config file"), ("extends = 3", "expected the file name"),
                      ('extends = "b.toml"', "a cycle")):
        bad = tmp_path / "parts" / "c.toml"
        bad.write_text(text + "\n")
        if why == "a cycle":
            (tmp_path / "parts" / "b.toml").write_text('extends = "c.toml"\n')
        with pytest.raises(ConfigError, match=why) as e:
            load_config(bad)
        assert "c.toml" in str(e.value) or "b.toml" in str(e.value)


def test_codec_specs() -> None:
    assert parse_codec("kmeans-4") == ("kmeans", 4)
    assert parse_codec("float32") == ("float32", 32)
    for bad in ("kmeans", "zip-4", "asym-0", "asym-x", 8):
        with pytest.raises(ConfigError):
            parse_codec(bad)


def test_a_paper_supplies_strategy_and_settings_and_the_config_overrides_them(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, 'paper = "fedshift"\n' + BASE + "[train]\nlr = 1.0\n"))
    assert cfg.strategy == "fedshift" and cfg.strategy_params == {"weighted": False}
    assert cfg.train["kmeans_method"] == "authors" and cfg.train["epochs"] == 10 and cfg.train["lr"] == 1.0
    with pytest.raises(ConfigError, match="paper"):
        load_config(write(tmp_path, 'paper = "fedfor"\n' + BASE))  # FedFOR's alpha must be given
    with pytest.raises(ConfigError, match="paper"):
        load_config(write(tmp_path, 'paper = "nope"\n' + BASE))
