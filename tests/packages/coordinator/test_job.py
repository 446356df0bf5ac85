"""``fedbit serve``'s job file (coordinator/job.py): the committed example, the TOML
conventions it shares with experiment files, flags and ``--set`` over the file, and a
real run started from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import ServerConfig, parse_assignments
from coordinator.emulation.config import load_config
from coordinator.job import FLAGS, SCHEMA, load_job
from coordinator.ops.admission import AdmissionConfig
from coordinator.ops.broker import free_port
from edge_client.errors import ConfigError
from edge_client.protocol import DEFAULT_LIMITS

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "job.toml"
BIN = Path(sys.executable).parent


def test_the_example_job_loads_with_its_values() -> None:
    job = load_job(EXAMPLE)
    assert (job.server.job, job.server.rounds, job.server.min_devices, job.out) == ("example", 5, 2, "runs/example")
    assert job.server.hparams == {"epochs": 1, "batch": 32}
    assert job.broker.url == "" and job.source == str(EXAMPLE)


def test_each_default_lives_in_one_place() -> None:
    """The job file, the experiment file and the round loop agree on every shared knob,
    because the schemas read their defaults from the dataclasses."""
    job, exp, server = load_job(None, {"out": "x"}), load_config(None), ServerConfig()
    for name in ("model", "strategy", "fraction", "quorum", "min_updates", "seed"):
        assert getattr(job.server, name) == getattr(server, name), name
    assert job.server.rounds == server.rounds
    assert exp.round.quorum == server.quorum and exp.round.min_updates == server.min_updates
    assert job.server.admission == AdmissionConfig() and job.server.limits == DEFAULT_LIMITS
    assert {key for _, key, _ in FLAGS} <= {f"{s}.{k}" if s else k for s, keys in SCHEMA.sections.items()
                                            for k in keys} | {"train.epochs", "train.batch", "train.steps"}


def test_overrides_win_over_the_file() -> None:
    job = load_job(EXAMPLE, {"rounds": 2, "round.quorum": 0.5, "strategy_params.weighted": False,
                             "train.lr": 0.1})
    assert job.server.rounds == 2 and job.server.quorum == 0.5
    assert job.server.strategy_params == {"weighted": False}
    assert job.server.hparams == {"epochs": 1, "batch": 32, "lr": 0.1}


@pytest.mark.parametrize(("text", "culprit"), [
    ('nosuch = 1', "nosuch: unknown key"),
    ('[round]\nnosuch = 1', "round.nosuch: unknown key"),
    ('[nosuch]\nx = 1', "nosuch: unknown key"),
    ('rounds = "many"', "rounds: expected int"),
    ('rounds = 0', "rounds: must be >= 1"),
    ('[round]\nquorum = true', "round.quorum: expected int or float"),
    ('[broker]\nsecurity = "maybe"', "broker.security: 'maybe' is not one of"),
    ('[train]\nbatch = 0', "batch"),
    ('rounds = [', "not valid TOML"),
])
def test_bad_job_files_name_the_file_and_the_key(tmp_path: Path, text: str, culprit: str) -> None:
    f = tmp_path / "job.toml"
    f.write_text('out = "x"\n' + text + "\n")
    with pytest.raises(ConfigError) as err:
        load_job(f)
    assert str(f) in str(err.value) and culprit in str(err.value)


def test_a_missing_run_directory_is_named() -> None:
    with pytest.raises(ConfigError, match="out: no run directory"):
        load_job(None)


def test_one_key_value_parser() -> None:
    assert parse_assignments(["a=5", "b=0.1", "c=true", "d=[0, 1]", 'e="x y"', "f=paper", "g.h=int8"]) == \
        {"a": 5, "b": 0.1, "c": True, "d": [0, 1], "e": "x y", "f": "paper", "g.h": "int8"}
    with pytest.raises(ConfigError, match="--hparam: 'lr' is not KEY=VALUE"):
        parse_assignments(["lr"], "--hparam")


@pytest.mark.slow
@pytest.mark.mosquitto
def test_serve_runs_from_the_example_job_file(tmp_path: Path, mosquitto_bin: str) -> None:
    """A real ``fedbit serve --config`` with two real devices: the file's settings, with
    ``--rounds`` and ``--set`` on top; a bad flag value is one line, not a traceback."""
    port = free_port()
    out = tmp_path / "run"
    coord = subprocess.Popen(
        [str(BIN / "fedbit"), "serve", "--config", str(EXAMPLE), "--out", str(out), "--rounds", "2",
         "--port", str(port), "--model", "mlp", "--set", "train.steps=4", "--set", "round.timeout_s=60",
         "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    devices = []
    try:
        for i, prof in enumerate(["raspberry-pi-4", "desktop"]):
            devices.append(subprocess.Popen(
                [str(BIN / "fedbit-edge"), "run", "--broker", f"mqtt://127.0.0.1:{port}", "--profile", prof,
                 "--data", f"digits:{i + 1}/2", "--id", f"dev{i}", "--job", "example",
                 "--workdir", str(tmp_path / f"dev{i}"), "--max-seconds", "120"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        stdout, stderr = coord.communicate(timeout=180)
    finally:
        for p in [coord, *devices]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)
    assert coord.returncode == 0, stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]                  # --rounds over the file's 5
    assert all(r["selected"] == 2 for r in records)                 # the file's min_devices = 2
    bad = subprocess.run([str(BIN / "fedbit"), "serve", "--config", str(EXAMPLE), "--set", "round.quorum=2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "quorum" in bad.stderr
