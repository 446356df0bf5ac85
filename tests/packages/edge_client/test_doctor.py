"""``fedbit-edge doctor`` holds a machine to its profile (issue 24): Python >= the profile's
``python``, the profile's ``arch`` (32-bit ARM fails, another machine warns), torch for a
float profile. Device-only: tools/py39_check.sh runs these under Python 3.9 too."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client.doctor import Check, check_image, check_python, check_torch, os_name
from hw_profiles import load_profile, profile_dir

BIN = Path(sys.executable).parent


def test_python_is_held_to_the_profile_s_floor() -> None:
    pi4, pi5 = load_profile("raspberry-pi-4"), load_profile("raspberry-pi-5")
    bullseye = check_python(pi4, (3, 9, 2))
    assert bullseye.ok and bullseye.detail == "3.9.2 (the raspberry-pi-4 profile needs >= 3.9)"
    old = check_python(pi5, (3, 9, 2))
    assert not old.ok
    assert old.detail.startswith("3.9.2 (the raspberry-pi-5 profile needs >= 3.11; Raspberry Pi OS")
    assert check_python(pi5, (3, 11, 0)).ok and not check_python(pi4, (3, 8, 10)).ok
    here = check_python(pi4)  # this interpreter: 3.9 in tools/py39_check.sh, 3.11 in make test
    assert here.ok and here.detail.startswith(platform.python_version() + " ")


def test_image_is_the_profile_s_machine(tmp_path: Path) -> None:
    pi4 = load_profile("raspberry-pi-4")
    release = tmp_path / "os-release"
    release.write_text('NAME="Debian GNU/Linux"\nPRETTY_NAME="Debian GNU/Linux 11 (bullseye)"\n')
    assert os_name(str(release)) == "Debian GNU/Linux 11 (bullseye)"
    assert os_name(str(tmp_path / "missing")) == platform.platform()
    for machine in ("aarch64", "arm64"):
        c = check_image(pi4, machine, str(release))
        assert (c.ok, c.warn) == (True, False), c
        assert c.line().startswith("PASS  image: Debian GNU/Linux 11 (bullseye), ")
        assert "the profile assumes Raspberry Pi OS (64-bit) bookworm" in c.detail
    arm32 = check_image(pi4, "armv7l", str(release))
    assert not arm32.ok and "32-bit OS; install the 64-bit image" in arm32.detail
    laptop = check_image(pi4, "x86_64", str(release))
    assert laptop.ok and laptop.warn and laptop.line().startswith("WARN  image:")
    assert laptop.detail.endswith("this machine is not aarch64")
    assert check_image(load_profile("desktop"), "AMD64", str(release)).line().startswith("PASS")


def test_a_float_profile_needs_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    c = check_torch(load_profile("jetson-orin-nano"))
    assert not c.ok and "trains in float32 with torch, which does not import (" in c.detail
    assert Check("x", False, "y", warn=True).line() == "FAIL  x: y"


def test_doctor_fails_a_python_older_than_the_profile_s(tmp_path: Path) -> None:
    """The command, as a subprocess: a profile whose images ship Python 3.99 fails this
    interpreter's python check (exit 1), naming the floor; the check list follows the
    profile (no torch check for an integer device)."""
    text = (profile_dir() / "raspberry-pi-4.toml").read_text()
    board = tmp_path / "future-board.toml"
    board.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith(("python ", "name ")))
                     + '\npython = "3.99"\nname = "future-board"\n')
    proc = subprocess.run([str(BIN / "fedbit-edge"), "doctor", "--profile", str(board)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert f"FAIL  python: {platform.python_version()} (the future-board profile needs >= 3.99" in lines[0]
    assert [ln.split(":")[0].split()[-1] for ln in lines[:-1]] == ["python", "image", "numba", "memory", "clock"]
    import llvmlite
    import numba
    import numpy

    assert lines[2].startswith(f"PASS  numba: {numba.__version__} (llvmlite {llvmlite.__version__}, "
                               f"numpy {numpy.__version__}), compiles; kernel cache "), lines[2]
    assert lines[-1].startswith("doctor: 4 of 5 checks passed; failed: python")
