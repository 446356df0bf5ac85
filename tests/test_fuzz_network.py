"""Fuzzing everything that arrives from the network or from a file a user hands over:
msgpack messages (raw bytes, mutated valid messages of every kind, structured maps with
wrong types and sizes), tensors and their aux through every codec's decode, round
announcements and models as a device handles them, the coordinator's authenticated
ingest, TOML hardware profiles, experiment configs and credentials files.

Two properties, for every input: only the project's error types escape (ProtocolError,
ConfigError, ProfileError, Rejected; nothing else), and nothing allocates more than the
input justifies: the tracemalloc peak of a decode stays under ``ALLOC_PER_BYTE`` bytes per
received byte plus ``ALLOC_BASE`` (a decoded float32 tensor is at most 32x its 1-bit
payload), so a short message cannot make the receiver allocate its declared maxima.

Hypothesis draws each example's ingredients (which valid message, which field, which
value, a seed for the byte mutations, applied by a seeded numpy generator); an example
fans out into up to 8 inputs (its k-th mutation), since hypothesis's own cost per example
(~2 ms on these shared cores) would otherwise dominate. ``FEDBIT_FUZZ_EXAMPLES`` inputs in all
(default 5,600 in ``make test``; ``make fuzz`` runs 105,000 with fresh randomness),
split evenly between the seven targets; each target fails if it ran fewer than its
share. ``make test`` derandomizes: the same inputs every run.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from coordinator.emulation.config import DEFAULT_CONFIG, load_config
from coordinator.ingest import Ingest, OpenRound, Rejected
from coordinator.ops.admission import AdmissionConfig
from edge_client import auth
from edge_client.codecs import (
    accumulator,
    available_codecs,
    can_accumulate,
    decode,
    encode,
    max_abs,
)
from edge_client.errors import ConfigError, ProtocolError
from edge_client.protocol import (
    CODEC_BITS,
    Hello,
    Limits,
    ModelMessage,
    Presence,
    RoundAnnouncement,
    Status,
    Update,
    decode_message,
    encode_message,
    float32_tensor,
    tensors_digest,
)
from edge_client.transport import Received
from firmware_models import get_spec
from hw_profiles.loader import ProfileError, load_profile, profile_dir

TARGETS = 7
TOTAL = int(os.environ.get("FEDBIT_FUZZ_EXAMPLES", "5600"))
EACH = max(1, TOTAL // TARGETS)
RANDOM = os.environ.get("FEDBIT_FUZZ_RANDOM", "") == "1"
ALLOC_PER_BYTE, ALLOC_BASE = 48, 256 * 1024
FUZZ = settings(max_examples=EACH, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate, Phase.shrink])

SPEC = get_spec("mlp")
SHAPES = [tuple(s) for s in SPEC.param_shapes()]
_RNG = np.random.default_rng(0)
SMALL = _RNG.normal(0, 0.1, size=(6, 5)).astype(np.float32)


def _tensors() -> list:
    """One valid tensor of every codec (small shapes)."""
    out = []
    for name in available_codecs():
        lo, hi = CODEC_BITS[name]
        if name == "int":
            out.append(encode(np.arange(-6, 6, dtype=np.int8).reshape(3, 4), "int", 8))
        elif name in ("float32", "float16"):
            out.append(encode(SMALL, name))
        else:
            out.append(encode(SMALL, name, min(hi, max(lo, 4))))
    return out


TENSORS = _tensors()
VALID = [
    encode_message(Hello("dev1", "pi", 8, "int", "int", 8, 120, "0.1")),
    encode_message(Presence("dev1", True)),
    encode_message(RoundAnnouncement("j", 3, "mlp", ("dev1", "dev2"), 1e9, {"float32": "a" * 64}, {"epochs": 1})),
    encode_message(ModelMessage(3, "float32", "mlp", tuple(TENSORS[:3]), tensors_digest(TENSORS[:3]))),
    encode_message(Update("dev1", 3, 10, 8, "weights", tuple(TENSORS))),
    encode_message(Status("round", 3, "x", {"accuracy": 0.5})),
]
#: bytes that mean something to msgpack (containers, lengths, reserved 0xc1)
_SPECIAL = np.array([0x00, 0xFF, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xC4, 0xC5, 0xC6, 0xD9, 0x7F, 0x90, 0x80, 0xA0],
                    np.uint8)


def mutate(base: bytes, seed: int) -> bytes:
    """1-6 random byte edits of ``base`` (flip, overwrite, insert, delete, truncate)."""
    rng = np.random.default_rng(seed)
    b = bytearray(base)
    for _ in range(int(rng.integers(1, 7))):
        op = int(rng.integers(0, 5))
        i = int(rng.integers(0, max(1, len(b))))
        if op == 0 and b:
            b[i] ^= 1 << int(rng.integers(0, 8))
        elif op == 1 and b:
            b[i] = int(rng.choice(_SPECIAL))
        elif op == 2:
            b[i:i] = rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8).tobytes()
        elif op == 3 and b:
            del b[i:i + int(rng.integers(1, 9))]
        elif op == 4:
            del b[i:]
    return bytes(b)


def bounded_peak(fn, n_bytes: int, *, warm: bool = False):
    """``fn()`` traced by tracemalloc: its peak must stay within the per-byte budget.
    ``warm``: run it once untraced first (numba compiles a kernel for a new argument type
    on its first call: that memory is the compiler's, not the input's)."""
    if warm:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the traced call raises it again
            pass
    tracemalloc.start()
    try:
        return fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= ALLOC_PER_BYTE * n_bytes + ALLOC_BASE, (peak, n_bytes)


seeds = st.integers(0, 2**63 - 1)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=40)
    | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=8)


def run_fuzz(strategy, body, fan_out: int = 1) -> None:
    """Feed EACH inputs to ``body``: hypothesis draws ``ceil(EACH / fan_out)`` examples of
    ``strategy``, and ``body(example, k)`` makes ``fan_out`` inputs of each (``k`` = 0..,
    e.g. the k-th mutation of its seed) and returns how many it fed; fails if fewer than
    EACH inputs ran."""
    fed = [0]

    @settings(FUZZ, max_examples=-(-EACH // fan_out))
    @given(strategy)
    def one(example) -> None:
        for k in range(fan_out):
            fed[0] += body(example, k)

    one()
    assert fed[0] >= EACH, (fed[0], EACH)


# --------------------------------------------------------------------------- messages


def test_fuzz_bytes_and_mutated_messages() -> None:
    raw = st.binary(max_size=600)
    mutated = st.builds(mutate, st.sampled_from(VALID), seeds)

    def body(payload: bytes, k: int) -> int:
        p = mutate(payload, k) if k else payload  # the drawn input, then mutations of it
        try:
            bounded_peak(lambda: decode_message(p), len(p))
        except ProtocolError:
            pass
        return 1

    run_fuzz(st.one_of(raw, mutated, mutated), body, fan_out=8)


def test_fuzz_structured_messages() -> None:
    """Maps shaped like messages, a field (of the message, a tensor or its aux) replaced
    by anything msgpack can carry."""

    def body(ex, k: int) -> int:
        base, where, pick, value = ex
        msg = msgpack.unpackb(base, raw=False)
        target = msg
        tensors = msg.get("tensors")
        if where != "message" and isinstance(tensors, list) and tensors:
            target = tensors[pick % len(tensors)]
            if where == "aux" and isinstance(target.get("aux"), dict):
                target = target["aux"]
        keys = sorted(target) + ["extra"]
        target[keys[pick % len(keys)]] = value
        payload = msgpack.packb(msg, use_bin_type=True)
        payload = mutate(payload, pick + k) if k else payload  # then byte mutations of it
        try:
            bounded_peak(lambda: decode_message(payload), len(payload))
        except ProtocolError:
            pass
        return 1

    run_fuzz(st.tuples(st.sampled_from(VALID), st.sampled_from(["message", "tensor", "aux"]),
                       st.integers(0, 99), values), body, fan_out=4)


def test_fuzz_every_codec_decode() -> None:
    """A valid tensor of each codec with its data bytes, an aux value or key, bits, shape
    or dtype changed: decode, max_abs and accumulator raise ProtocolError or work (and
    decode's float output then has the tensor's shape and is finite)."""

    def body(ex, k: int) -> int:
        t, what, seed, value = ex
        rng = np.random.default_rng(seed + k)
        f = {"shape": t.shape, "dtype": t.dtype, "codec": t.codec, "bits": t.bits, "data": t.data,
             "aux": dict(t.aux), "name": t.name}
        if what == "data":
            f["data"] = rng.integers(0, 256, size=len(t.data), dtype=np.uint8).tobytes()
        elif what == "aux" and t.aux:
            f["aux"][sorted(t.aux)[int(rng.integers(0, len(t.aux)))]] = value
        elif what == "aux_list" and t.aux:
            k = sorted(t.aux)[int(rng.integers(0, len(t.aux)))]
            f["aux"][k] = rng.choice([0.0, -1.0, 1e30, 3.4e38, np.nan, np.inf, 1.0],
                                     size=int(rng.integers(0, 300))).tolist()
        elif what == "aux_key":
            f["aux"][str(value)[:8]] = value
        elif what == "bits":
            f["bits"] = int(rng.integers(-2, 40))
        elif what == "shape":
            f["shape"] = tuple(int(d) for d in rng.integers(0, 40, size=int(rng.integers(0, 4))))
        else:
            f["dtype"] = str(rng.choice(["float32", "float16", "int8", "int16", "int32", "uint8", "x"]))
        bad = type(t)(**f)
        budget = len(bad.data) + 64 * len(repr(bad.aux))
        # (accumulator only where the coordinator calls it: can_accumulate; for ternary it
        # is a CodecError by contract, not a reaction to received bytes)
        for fn in (decode, max_abs) + ((accumulator,) if can_accumulate(bad) else ()):
            try:
                out = bounded_peak(lambda fn=fn: fn(bad), budget, warm=True)
            except ProtocolError:
                continue
            if fn is decode and out.dtype.kind == "f":
                assert out.shape == tuple(bad.shape) and np.isfinite(out).all()
        return 1

    run_fuzz(st.tuples(st.sampled_from(TENSORS),
                       st.sampled_from(["data", "aux", "aux_list", "aux_key", "bits", "shape", "dtype"]),
                       seeds, values), body, fan_out=4)


# --------------------------------------------------------------------------- the device side


class _Trainer:
    spec, bits, lr, lr_shift = SPEC, 32, 1.0, 3  # the Trainer protocol

    def load_shared(self, weights):
        self.w = [np.asarray(w, np.float32) for w in weights]

    def train(self, data, **_kw):
        return SimpleNamespace(loss=0.0)

    def to_shared(self):
        return [w.copy() for w in self.w]

    def int_weights(self):
        return None

    def ternary_weights(self):
        return None

    def evaluate(self, data, batch=256):
        return 0.0, 0.0


_MODEL_T = tuple(float32_tensor(np.zeros(s, np.float32)) for s in SHAPES)
DEVICE_VALID = {
    "round": encode_message(RoundAnnouncement("j", 2, "mlp", ("dev1",), 4e9, {"float32": tensors_digest(_MODEL_T)},
                                              {"epochs": 1, "run": "r"})),
    "model/float32": encode_message(ModelMessage(2, "float32", "mlp", _MODEL_T, tensors_digest(_MODEL_T))),
    "status": encode_message(Status("round", 2)),
}


def test_fuzz_rounds_and_models_as_a_device_handles_them(tmp_path: Path) -> None:
    """Mutated round announcements, models and statuses reach a device loop's handler and
    its training step; so does a forged model whose digest matches its (wrong-shaped,
    wrong-model) tensors, as a broker without the ACL could deliver. The device uses or
    ignores each; nothing escapes."""
    from edge_client.runtime import DeviceConfig, DeviceRuntime

    cfg = DeviceConfig("dev1", 32, "torch", "float32", 32, job="j", workdir=tmp_path)
    rt = DeviceRuntime(cfg, SimpleNamespace(x=np.zeros((4, 1, 8, 8), np.float32), y=np.zeros(4, np.int64)),
                       lambda **_: None, trainer_factory=lambda *a: _Trainer())
    rt.transport = SimpleNamespace(publish=lambda *a, **k: True, connected=True, connects=1)

    def body(ex, k: int) -> int:
        seeds_, which, forge, model_name, n_layers = ex
        rt.announcement, rt.models, rt.last_done = None, {}, -1
        for (name, valid), s, w in zip(DEVICE_VALID.items(), seeds_, which, strict=True):
            rt._handle(Received(f"fedbit/j/{name}", mutate(valid, s + k) if w else valid, 1, True))
        if forge:
            bad = tuple(type(t)(t.shape, t.dtype, t.codec, t.bits, bytes(len(t.data)), {}, t.name)
                        for t in _MODEL_T[:n_layers])
            forged = ModelMessage(2, "float32", model_name, bad, tensors_digest(bad))
            rt._handle(Received("fedbit/j/model/float32", encode_message(forged), 1, True))
            rt.announcement = RoundAnnouncement("j", 2, model_name, ("dev1",), 4e9,
                                                {"float32": forged.digest}, {"run": "r"})
        rt._maybe_train()
        return 1

    run_fuzz(st.tuples(st.tuples(seeds, seeds, seeds), st.tuples(st.booleans(), st.booleans(), st.booleans()),
                       st.booleans(), st.sampled_from(["mlp", "digits_cnn", "nope"]), st.integers(1, len(_MODEL_T))),
             body, fan_out=2)


# --------------------------------------------------------------------------- the coordinator side


def test_fuzz_authenticated_ingest(tmp_path: Path) -> None:
    """Signed, unsigned and mutated updates, hellos and presences through the coordinator's
    ingest with an enrolment registry: accepted or Rejected, nothing else; a payload whose
    MAC fails is never parsed."""
    from coordinator.ops.credentials import JobSecurity

    sec = JobSecurity(tmp_path / "security", "j")
    key = sec.enroll("dev1", broker="mqtt://127.0.0.1:1")[0].mac_key_bytes
    ing = Ingest("mlp", SHAPES, Limits(max_payload_bytes=1 << 20), AdmissionConfig(enrolment=str(sec.registry_path)), "j")
    upd = encode_message(Update("dev1", 1, 5, 32, "weights", _MODEL_T))

    def body(ex, k: int) -> int:
        base, sign, mut, seed, dev, kind = ex
        payload = auth.sign(base, key) if sign else base
        payload = mutate(payload, seed + k) if mut or k else payload
        try:
            if kind == "update":
                bounded_peak(lambda: ing.update(dev, payload, OpenRound(1, frozenset({"dev1"})), 0), len(payload),
                             warm=True)
            else:
                ing.device(kind, dev, payload, now=0.0)
        except Rejected as exc:
            if exc.reason not in ("unenrolled", "bad_mac"):
                assert auth.verify(payload, key)  # reached the parser: its MAC verified
        return 1

    run_fuzz(st.tuples(st.sampled_from([upd, VALID[0], VALID[1], VALID[4]]), st.booleans(), st.booleans(), seeds,
                       st.sampled_from(["dev1", "dev2"]), st.sampled_from(["update", "hello", "presence"])), body,
             fan_out=4)


# --------------------------------------------------------------------------- files users hand over

PROFILE_TEXT = (profile_dir() / "raspberry-pi-4.toml").read_text()
CONFIG_TEXT = Path(DEFAULT_CONFIG).read_text()
CREDS_TEXT = auth.Credentials("j", "dev1", "mqtts://h:8883", "dev1", "pw", auth.new_mac_key(), 10,
                              "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n").to_toml()
TOML_VALUES = ['1', '-1', '1e400', 'nan', '"x"', 'true', '[1, "a"]', '{a = 1}', '""', '0', '0.0',
               '99999999999999999999', '"../../etc"', '-inf', '[]', '"digits"', '"mqtt"', '1970-01-01']


def mutate_toml(text: str, seed: int) -> str:
    """Replace values, add keys, drop lines, or edit the bytes of a valid TOML file."""
    rng = np.random.default_rng(seed)
    lines = text.splitlines()
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 4))
        i = int(rng.integers(0, len(lines)))
        if op == 0 and "=" in lines[i]:
            lines[i] = lines[i].split("=")[0] + "= " + str(rng.choice(TOML_VALUES))
        elif op == 1:
            key = "".join(rng.choice(list("abcdefgh_."), size=int(rng.integers(1, 10))))
            lines.insert(i, f"{key} = {rng.choice(TOML_VALUES)}")
        elif op == 2 and len(lines) > 1:
            del lines[i]
        elif op == 3:
            return mutate(("\n".join(lines) + "\n").encode(), seed).decode("utf-8", "replace")
    return "\n".join(lines) + "\n"


def test_fuzz_hardware_profiles(tmp_path: Path) -> None:
    p = tmp_path / "board.toml"

    def body(seed: int, k: int) -> int:
        p.write_text(mutate_toml(PROFILE_TEXT, seed + k))
        try:
            load_profile(p)
        except (ProfileError, ConfigError):
            pass
        return 1

    run_fuzz(seeds, body, fan_out=4)


def test_fuzz_experiment_configs_and_credentials(tmp_path: Path) -> None:
    exp, cred = tmp_path / "exp.toml", tmp_path / "cred.toml"
    auth.write_private(cred, "")

    def body(ex, k: int) -> int:
        seed, which = ex
        seed += k
        if which:
            exp.write_text(mutate_toml(CONFIG_TEXT, seed))
            try:
                load_config(exp)
            except ConfigError:
                pass
        else:
            cred.write_text(mutate_toml(CREDS_TEXT, seed))  # (mode 0600: set once below)
            try:
                auth.load_credentials(cred)
            except ConfigError:
                pass
        return 1

    run_fuzz(st.tuples(seeds, st.booleans()), body, fan_out=4)


@pytest.mark.parametrize("target", ["decode_message"])
def test_a_huge_declared_size_is_refused_before_allocating(target: str) -> None:
    """The allocation bound is real: a 60-byte update declaring 2^25 float32 elements is
    refused without allocating them (tracemalloc), and a 1-bit payload decodes to at most
    32x its bytes."""
    body = msgpack.unpackb(VALID[4], raw=False)
    body["tensors"][0]["shape"] = [1 << 25]
    payload = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(ProtocolError, match="expected ceil"):
        bounded_peak(lambda: decode_message(payload), len(payload))
    t = encode(np.zeros(80_000, np.float32), "asym", 1)
    out = bounded_peak(lambda: decode(t), len(t.data))
    assert out.size == 80_000 and len(t.data) == 10_000
