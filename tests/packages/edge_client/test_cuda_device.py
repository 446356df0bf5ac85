"""The CUDA engine on a device: the profiles' ``engine``, ``--engine cpu|cuda|auto``
(auto falls back to the CPU and says why; cuda where it cannot run is refused with the
reason), ``doctor``'s gpu line (none here: numba's real CUDA target finds no GPU on this
machine; the GPU where there is one), ``warmup`` on the CUDA engine (under Numba's CUDA simulator)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edge_client import cli
from edge_client.errors import ConfigError
from edge_client.intnn.cuda import probe
from edge_client.intnn.cuda.probe import choose
from edge_client.warmup import warm_up
from hw_profiles import ProfileError, load_profile, parse_profile

NO_SIM = os.environ | {"NUMBA_ENABLE_CUDASIM": "0"}  # numba's real CUDA target: no GPU here

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def test_the_jetson_profiles_name_their_engine() -> None:
    assert load_profile("jetson-orin-nano-int8").engine == "auto"
    assert load_profile("jetson-nano").engine == "cpu"
    assert load_profile("raspberry-pi-4").engine == "cpu"  # the default
    table = {k: v for k, v in load_profile("jetson-orin-nano").__dict__.items()}
    with pytest.raises(ProfileError, match="a float device .* trains on the CPU"):
        parse_profile(table | {"engine": "cuda"}, "f.toml")
    with pytest.raises(ProfileError, match="'engine' = 'tpu' must be one of"):
        parse_profile({**load_profile("raspberry-pi-4").__dict__, "engine": "tpu"}, "p.toml")


def test_auto_takes_the_cpu_and_says_why_cuda_is_refused_where_it_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``choose`` and ``run --engine`` with the probe's answer on a machine without a GPU
    (this process runs the simulator; the doctor test below asks numba's real target)."""
    assert choose("auto")[0] == "cuda"  # the simulator of this process (tests/conftest.py)
    monkeypatch.setattr(probe, "usable", lambda: (False, "no CUDA GPU or driver found (probe)"))
    assert choose("cpu") == ("cpu", "integer engine on the CPU")
    assert choose("auto") == ("cpu", "integer engine on the CPU (engine auto: no CUDA GPU or driver found (probe))")
    with pytest.raises(ConfigError, match=r"the cuda engine cannot run here: no CUDA GPU or driver found \(probe\)"):
        choose("cuda")
    argv = ["run", "--profile", "jetson-orin-nano-int8", "--engine", "cuda", "--data", "digits:1/4", "--broker",
            "mqtt://127.0.0.1:9", "--id", "j1", "--workdir", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "fedbit-edge run: error: the cuda engine cannot run here: no CUDA GPU" in capsys.readouterr().err


def test_doctor_says_plainly_whether_there_is_a_gpu_here() -> None:
    """Numba's real CUDA target (not the simulator): without an NVIDIA driver (no
    nvidia-smi, as on CI) the gpu line warns that engine auto trains on the CPU; on a GPU
    machine it names the GPU and its compute capability and the kernels compile."""
    proc = subprocess.run([sys.executable, "-c", "import sys; from edge_client.cli import main; sys.exit(main())",
                           "doctor", "--profile", "jetson-orin-nano-int8"],
                          capture_output=True, text=True, env=NO_SIM, timeout=300)
    gpu = [ln for ln in proc.stdout.splitlines() if ln.split(":")[0].endswith("gpu")]
    assert gpu, proc.stdout + proc.stderr
    if shutil.which("nvidia-smi") is None:
        assert gpu[0].startswith("WARN  gpu: none here: no CUDA GPU or driver found"), proc.stdout
        assert "engine auto trains on the CPU" in gpu[0]
    else:
        assert not gpu[0].startswith(("WARN", "FAIL")), proc.stdout
        assert "compute capability" in gpu[0] and "kernels compile for it" in gpu[0], gpu[0]


def test_warmup_runs_a_step_on_the_cuda_engine(tmp_path: Path) -> None:
    model = tmp_path / "tiny.toml"
    model.write_text('input = [1, 4, 4]\nlayers = [{type = "flatten"}, {type = "linear", out = 3}]\n')
    rep = warm_up(load_profile("jetson-orin-nano-int8"), str(model), batch=2, engine="cuda")
    assert rep.compiled and rep.engine == "cuda" and rep.bits == 8
