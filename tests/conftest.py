"""Shared fixtures: real MQTT brokers on free loopback ports, always stopped by PID.

``mosquitto`` tests skip with a visible reason when the binary is not on PATH, except
under ``CI=true`` where a missing mosquitto is a failure. The coordinator is imported by
the fixtures that need it, not here: the device-side subset (``pytest -m device``, marked
here from tests/device_tests.txt) runs under Python 3.9, where the coordinator does not import.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import pytest

# The CUDA engine's kernels run under Numba's CUDA simulator in the tests unless told
# otherwise (make gpu-check sets NUMBA_ENABLE_CUDASIM=0 on a GPU): numba reads it on import.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

if TYPE_CHECKING:
    from coordinator.ops.broker import AmqttBroker, MosquittoBroker


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the device-side subset ``device``: the tests of the modules
    tests/device_tests.txt lists, except those marked ``host`` (``pytest -m device``)."""
    from device_subset import is_device_test, read_manifest

    selection = read_manifest()
    for item in items:
        if is_device_test(item.nodeid, item.get_closest_marker("host") is not None, selection):
            item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def mosquitto_bin() -> str:
    """Path of the mosquitto binary; skip (fail under CI=true) when it is missing."""
    path = shutil.which("mosquitto")
    if path is None:
        msg = "mosquitto is not on PATH (apt-get install mosquitto; Debian puts it in /usr/sbin)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {msg}")
        pytest.skip(msg)
    return path


def need_tool(name: str, install: str) -> str:
    """Path of command ``name``; skip without it (fail under CI=true: .ci/run installs it)."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not on PATH ({install})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {msg}")
        pytest.skip(msg)
    return path


def wait_for(cond, timeout: float, what: str, step: float = 0.05):
    """Poll ``cond()`` every ``step`` s until it is truthy and return its value;
    ``AssertionError`` naming ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class ShiftTrainer:
    """A float32 trainer whose local "training" adds ``shift`` to every weight: a device's
    update is exactly that constant, so an aggregate is checkable exactly. ``on_train``
    (optional) runs at the start of each local round. The Trainer protocol's attributes;
    ``spec`` is not read by the device runtime."""

    spec, bits, lr, lr_shift = None, 32, 1.0, 3

    def __init__(self, shift: float = 0.01, on_train=None) -> None:
        self.shift, self.on_train = np.float32(shift), on_train
        self.w: list[np.ndarray] = []

    def load_shared(self, weights) -> None:
        self.w = [np.array(w, dtype=np.float32) for w in weights]

    def train(self, data, **_kw):
        if self.on_train is not None:
            self.on_train()
        self.w = [w + self.shift for w in self.w]
        return SimpleNamespace(loss=0.1, steps=1, samples=len(getattr(data, "y", ())), seconds=0.0)

    def to_shared(self) -> list[np.ndarray]:
        return [w.copy() for w in self.w]

    def int_weights(self):
        return None

    def ternary_weights(self):
        return None

    def evaluate(self, data, batch: int = 256):
        return 0.0, 0.0


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (``pytestmark = pytest.mark.usefixtures(
    "one_torch_thread")``): bit-reproducible float training, and tiny networks spend
    no time in a thread pool on a shared 2-core machine. The thread count is restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def openssl_bin() -> str:
    """Path of ``openssl`` (makes the job CA and certificates)."""
    return need_tool("openssl", "apt-get install openssl")


@pytest.fixture(scope="session")
def mosquitto_passwd_bin() -> str:
    """Path of ``mosquitto_passwd`` (Debian's mosquitto package has it)."""
    return need_tool("mosquitto_passwd", "apt-get install mosquitto")


@pytest.fixture
def mosquitto(mosquitto_bin: str, tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A mosquitto child process on a free loopback port (persistence on, in tmp_path)."""
    from coordinator.ops.broker import MosquittoBroker

    broker = MosquittoBroker(binary=mosquitto_bin, workdir=tmp_path / "mosquitto",
                             persistence=True)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def amqtt_broker() -> Iterator[AmqttBroker]:
    """amqtt in this process on a free loopback port (MQTT 3.1.1 only)."""
    from coordinator.ops.broker import AmqttBroker

    broker = AmqttBroker().start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(params=["mosquitto", "amqtt"])
def any_broker(request: pytest.FixtureRequest):
    """Each broker kind in turn."""
    return request.getfixturevalue("mosquitto" if request.param == "mosquitto" else "amqtt_broker")


@pytest.fixture(scope="session")
def onnx_runtime() -> None:
    """onnx and onnxruntime are importable (the ``onnx`` extra, which ``make test``
    installs); skip without them, except under CI=true where that is a failure."""
    import importlib.util

    for module in ("onnx", "onnxruntime"):
        if importlib.util.find_spec(module) is None:
            msg = f"{module} is not installed (pip install 'fedbit[onnx]')"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"CI=true: {msg}")
            pytest.skip(msg)


@pytest.fixture(scope="session")
def fashion_mnist() -> str:
    """The folder of Debian's ``dataset-fashion-mnist`` (IDX files); skip without it,
    except under CI=true where that is a failure (.ci/run installs the package)."""
    from edge_client.data import FASHION_MNIST_DIR, FASHION_MNIST_PACKAGE

    if not os.path.isfile(os.path.join(FASHION_MNIST_DIR, "train-images-idx3-ubyte.gz")):
        msg = (f"Fashion-MNIST is not in {FASHION_MNIST_DIR} "
               f"(apt-get install {FASHION_MNIST_PACKAGE})")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {msg}")
        pytest.skip(msg)
    return FASHION_MNIST_DIR


@pytest.fixture(autouse=True)
def _fedbit_logger_restored() -> Iterator[None]:
    """A test that runs a command in-process configures the ``fedbit`` logger tree (its
    level, handler, propagation: ``edge_client.logs.setup_logging``); put it back after
    the test, so that a later test's ``caplog`` sees every record of every level."""
    log = logging.getLogger("fedbit")
    level, handlers, propagate = log.level, list(log.handlers), log.propagate
    yield
    log.setLevel(level)
    log.handlers[:] = handlers
    log.propagate = propagate
