# fedbit — the README's commands. Each target creates .venv when missing and installs
# the project with the extras it needs.
#
# torch is pinned (torch==2.13.0 in the `coordinator` extra) so that pip takes the CPU
# wheel a machine already has; an unpinned torch would pull a multi-GB CUDA build.
# Every other dependency installs at the version constraints.txt pins for this Python (the
# versions the tests and benchmarks were made with); `make lock` rewrites this Python's
# block from .venv (README, "Two commands").

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= coordinator,data,dev,onnx,cluster
CONSTRAINTS ?= constraints.txt

.PHONY: demo test test-device bench bench-flower experiments fuzz faults wheel device-check py39-check gpu-check gpu-wheels ptx-check install lock lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# Re-install when pyproject.toml or the constraints change.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	@touch $@

install: $(VENV)/.installed

# constraints.txt's block for this Python from what .venv has installed (after upgrading a
# package there and passing make test / make bench with it)
lock:
	$(PY) tools/lock.py --extras $(EXTRAS) --out $(CONSTRAINTS)

demo: install
	$(VENV)/bin/fedbit demo

# The suite on TEST_WORKERS processes (pytest-xdist), each taking a whole test file at a time
# (module fixtures built once); 2 fills the 2-core machine the suite's budget is set on.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The device-side tests alone (pytest marker `device`: the modules of tests/device_tests.txt
# less their `host` tests), on this Python; make py39-check runs them under 3.9.
test-device: install
	$(PY) -m pytest -q -m device

bench: install
	$(PY) benchmarks/run_all.py --out benchmarks/results/latest.jsonl

# The emulator against Flower 1.40's simulation engine, and SecAgg+ against Flower's
# SecAggPlusWorkflow, side by side in one run each: Flower in
# its own venv (.venv-flower, never a fedbit dependency), torch pinned as for fedbit.
FLOWER_VENV ?= .venv-flower
$(FLOWER_VENV)/bin/python:
	$(PYTHON) -m venv $(FLOWER_VENV)
	$(FLOWER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOWER_VENV)/bin/python -m pip install --quiet "flwr[simulation]==1.40.*" "torch==2.13.0" scikit-learn psutil

bench-flower: install $(FLOWER_VENV)/bin/python
	$(PY) benchmarks/emulator_scale.py --flower $(FLOWER_VENV)/bin/python
	$(PY) benchmarks/secagg.py --flower $(FLOWER_VENV)/bin/python

# The papers' experiments on the emulator (every config in experiments/: fmnist-* on
# Fashion-MNIST, >= 5 seeds, hours; the others their digits versions); ONLY=name runs
# one (or several, space-separated); results under runs/experiments/, summaries copied to
# benchmarks/results/experiments/. ESTIMATE=R times R rounds of a covering set of
# combinations instead and estimates each experiment's full time; SET="k=v ..." overrides
# keys of every config (SET="data.dataset=cifar10 data.path=DIR model=fedshift_cnn");
# RESUME=1 goes on with experiments a killed run left in runs/experiments (finished runs kept).
ONLY ?=
ESTIMATE ?=
SET ?=
RESUME ?=
experiments: install
	$(PY) experiments/run_all.py --out runs/experiments $(if $(ESTIMATE),--estimate $(ESTIMATE)) $(if $(RESUME),--resume) $(foreach s,$(SET),--set $(s)) $(ONLY)

# Fuzzing of every network input, 105,000 inputs with fresh randomness (make test runs
# 5,600 of the same inputs every time).
FUZZ_EXAMPLES ?= 105000
fuzz: install
	FEDBIT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FEDBIT_FUZZ_RANDOM=1 $(PY) -m pytest -q -p no:cacheprovider tests/system/test_fuzz_network.py

# The fault-injection suite, every fault and attack FAULT_TRIALS times at other kill points
# (make test runs each once); prints the table of outcomes (runs/faults.jsonl).
FAULT_TRIALS ?= 10
faults: install
	@mkdir -p runs && rm -f runs/faults.jsonl
	FEDBIT_FAULT_TRIALS=$(FAULT_TRIALS) FEDBIT_FAULT_REPORT=runs/faults.jsonl $(PY) -m pytest -q -p no:cacheprovider tests/system/faults
	$(PY) tests/system/faults/table.py runs/faults.jsonl

# The sdist and the pure-Python wheel a device installs (dist/fedbit-<version>-py3-none-any.whl;
# see README "Install on a device"): the profiles and model specs inside, torch only in extras.
wheel: install
	$(PY) -m build --no-isolation --outdir dist .

# fedbit on 64-bit ARM under qemu, Debian bookworm (Python 3.11) and bullseye (3.9) (root;
# ~20 minutes a suite the first time, the root filesystems are cached): docs/device.md's
# install from the wheel, Int8 training, an update counted by a coordinator on the host.
# Not part of make test nor of .ci/run.
device-check: install
	PY=$(PY) tools/device_check.sh

# The device side under Debian bullseye's Python 3.9 on this x86_64 machine (root; the
# root filesystem is cached under ~/.cache/fedbit): the wheel, the device-side tests
# (tests/device_tests.txt), Int8 training throughput vs this Python, a round over MQTT; at
# constraints.txt's 3.9 versions (FEDBIT_LOCK_REFRESH=1: resolved afresh, and written there
# when every check passes). .ci/run runs it after make test.
py39-check: install
	PY=$(PY) tools/py39_check.sh

# The CUDA engine on a GPU machine (tools/gpu_check.py: its tests on the GPU, a 3-round fleet
# against the CPU emulator byte for byte, benchmarks/gpu.py), <= 8 minutes, JSON lines in
# $(OUT) (default gpu-check/). Uses the machine's Python as it is (GPU_PY; numba-cuda and
# torch installed there, no package index: missing wheels come from $(OUT)/wheels, which
# `make gpu-wheels` fills where there is an index). QUICK=1: small, under Numba's CUDA
# simulator (the script's path on a machine without a GPU).
GPU_PY ?= python3
OUT ?= gpu-check
QUICK ?=
gpu-check:
	$(GPU_PY) tools/gpu_check.py --out $(OUT) $(if $(QUICK),--quick)

# The wheels gpu-check may lack on the GPU machine (GPU_PYTHON: its Python version)
GPU_PYTHON ?= 3.11
gpu-wheels: install
	$(PY) -m pip download --quiet --only-binary=:all: --python-version $(GPU_PYTHON) \
	    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d $(OUT)/wheels \
	    msgpack paho-mqtt cryptography pytest scipy matplotlib aiohttp rich prometheus-client scikit-learn

# Every CUDA kernel compiled to PTX for the Jetsons' compute capabilities (Nano 5.3, Xavier
# 7.2, Orin 8.7) and the H100's (9.0), no GPU needed: numba-cuda with CUDA 12's NVVM (pip
# wheels) in a venv of its own (.venv-cuda12; CUDA 13's NVVM has no sm < 7.5).
CUDA_VENV ?= .venv-cuda12
$(CUDA_VENV)/bin/python:
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CUDA_VENV)/bin/python -m pip install --quiet -c $(CONSTRAINTS) numpy numba msgpack paho-mqtt "numba-cuda[cu12]==0.30.4"

ptx-check: $(CUDA_VENV)/bin/python
	PYTHONPATH=. $(CUDA_VENV)/bin/python tools/ptx_check.py

lint: install
	$(PY) -m ruff check edge_client coordinator firmware_models hw_profiles tests benchmarks experiments tools

clean:
	rm -rf $(VENV) $(FLOWER_VENV) .pytest_cache .hypothesis build *.egg-info
