"""The wheel a device installs (issue 15, ``make wheel``): pure Python, the hardware
profiles and the default experiment inside, no torch in its base requirements, and
``fedbit-edge`` runs from it alone (not from this checkout)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("fedbit-*-py3-none-any.whl")
    return whl


def test_the_wheel_carries_profiles_and_specs_and_no_torch(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    profiles = {Path(n).stem for n in names if n.startswith("hw_profiles/profiles/") and n.endswith(".toml")}
    assert {"raspberry-pi-zero-2w", "raspberry-pi-4", "raspberry-pi-5", "jetson-nano", "jetson-orin-nano",
            "desktop"} <= profiles
    assert {"firmware_models/zoo.py", "coordinator/emulation/default.toml", "edge_client/cli.py"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/", "experiments/")) for n in names)
    base = [ln.split(":", 1)[1].strip() for ln in meta.splitlines()
            if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert sorted(b.split(">")[0].split("<")[0].split("=")[0] for b in base) == \
        ["cryptography", "msgpack", "numba", "numpy", "paho-mqtt", "tomli"]
    # the device side's floor (issue 24): Python 3.9, tomli only where tomllib is missing
    assert "Requires-Python: >=3.9" in meta.splitlines()
    assert any(b.startswith("tomli") and 'python_version < "3.11"' in b for b in base), base


def test_fedbit_edge_runs_from_the_unpacked_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = ("import sys; from edge_client.cli import main; import edge_client; "
            "assert edge_client.__file__.startswith(sys.argv[1]), edge_client.__file__; "
            "sys.exit(main(sys.argv[2:]))")
    # -I: isolated (no cwd, no PYTHONPATH, no user site); the venv's numpy etc. via -c's path
    site_packages = next(p for p in sys.path if p.endswith("site-packages"))
    args = [sys.executable, "-I", "-c", f"import sys; sys.path[:0] = [{str(site)!r}, {site_packages!r}]; " + code,
            str(site)]
    v = subprocess.run(args + ["--version"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert v.returncode == 0 and v.stdout.startswith("fedbit-edge "), v.stdout + v.stderr
    p = subprocess.run(args + ["profiles"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and "raspberry-pi-zero-2w" in p.stdout, p.stdout + p.stderr
