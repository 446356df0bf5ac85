"""The two console scripts, run as real subprocesses from the environment's bin folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    exe = BIN / args[0]
    assert exe.exists(), f"{exe} is not installed: run `make install`"
    return subprocess.run([str(exe), *args[1:]], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", [pytest.param("fedbit", marks=pytest.mark.host), "fedbit-edge"])
def test_help_and_version(script: str) -> None:
    helped = run(script, "--help")
    assert helped.returncode == 0, helped.stderr
    assert f"usage: {script}" in helped.stdout
    version = run(script, "--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"{script} 0.1.0"


def test_edge_profiles_lists_the_bundled_profiles() -> None:
    out = run("fedbit-edge", "profiles")
    assert out.returncode == 0, out.stderr
    for name in ["raspberry-pi-zero-2w", "raspberry-pi-4", "raspberry-pi-5", "jetson-nano", "jetson-orin-nano", "desktop"]:
        assert name in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("raspberry-pi-zero-2w"))
    assert line.split()[1] == "6"


def test_edge_warmup_runs_a_round_s_code_for_integer_profiles_only() -> None:
    import json

    out = run("fedbit-edge", "warmup", "--profile", "raspberry-pi-zero-2w")
    assert out.returncode == 0, out.stderr
    assert "compiling kernels" in out.stderr and "first run only" in out.stderr
    rep = json.loads(out.stdout)
    assert rep["compiled"] is True and rep["bits"] == 6 and rep["train_s"] > 0 and rep["encode_s"] > 0
    out = run("fedbit-edge", "warmup", "--profile", "desktop")
    assert out.returncode == 0 and json.loads(out.stdout)["compiled"] is False
    out = run("fedbit-edge", "warmup", "--profile", "pi-9000")
    assert out.returncode == 1 and "unknown profile 'pi-9000'" in out.stderr


def test_unknown_subcommand_fails() -> None:
    out = run("fedbit-edge", "fly")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


@pytest.mark.host
def test_serve_refuses_a_magnitude_limit_that_lets_sums_overflow(tmp_path: Path) -> None:
    out = run("fedbit", "serve", "--out", str(tmp_path / "run"), "--max-abs-value", "1e30")
    assert out.returncode == 1
    assert "max_abs_value" in out.stderr and "1e+30" in out.stderr
    assert not (tmp_path / "run").exists()       # refused before anything started


@pytest.mark.host
def test_serve_names_a_bad_dequantizer_parameter(tmp_path: Path) -> None:
    """``--strategy prowd`` takes the dequantizer's settings as ``dequantize.K=V``; an
    unknown one is refused before anything starts, and named."""
    out = run("fedbit", "serve", "--out", str(tmp_path / "run"), "--strategy", "prowd",
              "--strategy-param", "dequantize.ladder=paper", "--strategy-param", "dequantize.epoch=3")
    assert out.returncode == 1
    assert "epoch" in out.stderr and "unknown parameters" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.host
def test_emulate_refuses_a_bad_config_naming_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[devices]\nraspberry-pi-4 = 2\n[round]\nquorum = 2.0\n')
    out = run("fedbit", "emulate", str(bad), "--out", str(tmp_path / "run"))
    assert out.returncode == 1
    assert str(bad) in out.stderr and "round.quorum" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.host
def test_serve_names_an_unknown_model_in_one_line(tmp_path: Path, capsys) -> None:
    from coordinator.cli import main

    assert main(["serve", "--model", "nosuch", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model: 'nosuch' is not one of" in err and "mlp" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.host
def test_emulate_checks_every_sweep_combination_before_writing_anything(tmp_path: Path) -> None:
    """A bad profile or value in one combination of a sweep is refused before the header
    is printed and before the run folder exists (not after the first combinations ran)."""
    for sweep, key in (('"@fleet" = [{label = "ok", "devices.raspberry-pi-4" = 2}, '
                        '{label = "bad", "devices.nosuch-board" = 1}]', "nosuch-board"),
                       ('"data.partition" = ["iid", "nope"]', "data.partition"),
                       ('"codecs.raspberry-pi-4" = ["int-8", "kmeans-9"]', "codecs.raspberry-pi-4")):
        cfg = tmp_path / "sweep.toml"
        cfg.write_text(f'name = "x"\nrounds = 1\n[devices]\nraspberry-pi-4 = 1\n[sweep]\n{sweep}\n')
        out = run("fedbit", "emulate", str(cfg), "--out", str(tmp_path / "em"))
        assert out.returncode == 1 and out.stdout == "", out.stdout
        assert key in out.stderr and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / "em").exists()
