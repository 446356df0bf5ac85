"""``dequantize="prowd"``: the ProWD progressive weight dequantizer as a strategy stage.

The strategy calls its hooks each round. ``begin_round`` adds the round's global model to
the training models; ``observe`` adds a float32 device's lossless weights (at most
``models_per_round``); ``__call__`` takes a low-bit device's ``weights`` update and runs
each layer whose values sit on a ladder rung's grid through the version in use, from that
rung up, where its held-out check passed (any other layer, and any update while no
version is ready, is plain dequantization); ``end_round`` pools the round's models and,
every ``train_every`` rounds, starts training the next version in a background thread
(``background = false``: in the caller). Which version a round applies depends on round
numbers only, never on wall-clock time. A failed training is logged, counted
(``dequantizer_failures``) and leaves no version; the coordinator never sees the
exception. The version in use is saved with the strategy's checkpoint. The schedule,
held-out set and slice tables: docs/algorithms.md §4.
"""

from __future__ import annotations

import atexit
import copy
import logging
import math
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from coordinator.strategies.kernels import has_nonfinite
from coordinator.strategies.prowd_dequantizer.blocks import BlockLayout
from coordinator.strategies.prowd_dequantizer.config import DequantizerConfig
from coordinator.strategies.prowd_dequantizer.ladder import grid_precision
from coordinator.strategies.prowd_dequantizer.network import build_network
from coordinator.strategies.prowd_dequantizer.slices import (
    SliceLayout,
    build_slice_net,
    compile_tables,
    flat_inputs,
)
from coordinator.strategies.prowd_dequantizer.slicetrain import (
    Pair,
    SliceVersion,
    dequantize_layer,
    table_rungs,
    train_slices,
)
from coordinator.strategies.prowd_dequantizer.slicetrain import heldout_l1 as slice_heldout_l1
from coordinator.strategies.prowd_dequantizer.train import (
    Distillation,
    TrainingStopped,
    train_network,
)
from coordinator.strategies.prowd_dequantizer.version import (
    Version,
    decide_gates,
    heldout_l1,
    make_tables,
)
from coordinator.strategies.types import FLOAT_BITS, ClientUpdate
from edge_client.errors import ConfigError, ProtocolError

log = logging.getLogger("fedbit.dequantizer")

STATE_FORMAT = 1
CLOSE_TIMEOUT_S = 30.0
#: every stage alive, closed at interpreter exit: a torch training still running in a
#: daemon thread while the interpreter finalizes can abort the process
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for stage in list(_LIVE):
        stage.close()


def load_buffer(source: str | np.ndarray, input_shape: Sequence[int], size: int, seed: int) -> np.ndarray:
    """The server's unlabeled inputs, float32 [size, *input_shape] in [0, 1]:
    ``"noise"`` (uniform noise images), a data source (``edge_client.data.load_source``:
    ``"digits:test"``, ``"fashion-mnist:train"``, ``"digits:K/N"``, an IDX or CIFAR-10
    folder; its training split unless it names a part), or an array. ConfigError naming the source when it does not fit the model."""
    shape = tuple(int(d) for d in input_shape)
    rng = np.random.default_rng(seed)
    if isinstance(source, np.ndarray):
        x = np.asarray(source, dtype=np.float32)
    elif source == "noise":
        return rng.random((size, *shape), dtype=np.float32)
    elif isinstance(source, str):
        from edge_client.data import float_images, load_source

        x = float_images(load_source(source).x)
    else:
        raise ConfigError(f"dequantizer: buffer must be 'noise', a data source or an array, got {source!r}")
    if x.ndim != len(shape) + 1 or tuple(x.shape[1:]) != shape or len(x) == 0:
        raise ConfigError(f"dequantizer: buffer {source if isinstance(source, str) else 'array'} holds "
                          f"samples of shape {list(x.shape[1:])}, the model takes {list(shape)}")
    pick = rng.choice(len(x), min(size, len(x)), replace=False)
    return np.ascontiguousarray(x[np.sort(pick)], dtype=np.float32)


@dataclass
class RoundData:
    """What a round leaves for training: its global model, float32 devices' weights and
    integer devices' received weights with each layer's entry rung (0: on no rung)."""

    round_id: int
    glob: list[np.ndarray]
    floats: list[list[np.ndarray]] = field(default_factory=list)
    ints: list[tuple[list[np.ndarray], tuple[int, ...]]] = field(default_factory=list)

    @property
    def models(self) -> list[list[np.ndarray]]:
        """The block network's training models: the global model, then the floats."""
        return [self.glob, *self.floats]


class ProwdDequantizer:
    """The stage (see the module docstring). ``model``: the model spec's name (the
    distillation term needs the network; without it only the reconstruction loss is
    trained). ``buffer``: the unlabeled inputs (:func:`load_buffer`). Every other
    parameter is a :class:`DequantizerConfig` field."""

    name = "prowd"

    def __init__(self, model: str | None = None, buffer: str | np.ndarray = "noise", **params: Any
                 ) -> None:
        self.cfg = DequantizerConfig.from_params(**params)
        self.spec = None
        self._buffer: np.ndarray | None = None
        if model is not None:
            from firmware_models import SpecError, resolve_model

            try:
                self.spec = resolve_model(model)
            except SpecError as exc:
                raise ConfigError(f"dequantizer: {exc}") from None
            if self.cfg.lam > 0:
                self._buffer = load_buffer(buffer, self.spec.input_shape, self.cfg.buffer_size, self.cfg.seed)
        self._lock = threading.Lock()
        self._version: Version | SliceVersion | None = None  # the last finished one; None: plain
        self._next_number = 1
        self._failures = 0
        self._thread: threading.Thread | None = None  # the background training not yet put in use
        self._started = -(1 << 30)  # the round after which the last training started
        self._trained: list[Version | SliceVersion | None] = []  # what it left (empty: nothing, stopped)
        self._pool: list[RoundData] = []
        self._round: RoundData | None = None
        self._layout: BlockLayout | SliceLayout | None = None
        self._counts: dict[str, int | float] = {}
        self._stop = threading.Event()
        # the anchored slice form: the tables of the round in progress and the version they are of
        self._rungs: set[int] = set(table_rungs(self.cfg)) if self.cfg.slices else set()  # compiled
        self._seen: set[int] = set()  # entry rungs of this round's integer updates
        self._tables: tuple[SliceVersion, dict[int, list[np.ndarray]]] | None = None
        self._compiled = threading.Event()
        self._compiler: threading.Thread | None = None
        _LIVE.add(self)

    @property
    def anchored(self) -> bool:
        return self.cfg.slices and self.cfg.context == "global"

    # ------------------------------------------------------------------ hooks
    def begin_round(self, round_id: int, global_weights: Sequence[np.ndarray]) -> None:
        """A round opens from ``global_weights`` (float32, spec order)."""
        shapes = [tuple(int(d) for d in w.shape) for w in global_weights]
        if self.spec is not None and shapes != [tuple(s) for s in self.spec.param_shapes()]:
            raise ConfigError(f"dequantizer: the round's model does not match {self.spec.name}")
        if self._layout is None or self._layout.shapes != shapes:
            self._layout = (SliceLayout(shapes, flat_inputs(self.spec)) if self.cfg.slices
                            else BlockLayout(shapes, self.cfg.block, self.cfg.modules))
        glob = [np.array(w, dtype=np.float32) for w in global_weights]
        self._round = RoundData(int(round_id), glob)
        self._counts = {"updates": 0, "passed": 0, "fallback": 0, "layers_on": 0, "layers_off": 0,
                        "wait_s": 0.0}
        if self._seen:  # compile the rungs the last round's integer updates came in on
            self._rungs, self._seen = self._seen & set(table_rungs(self.cfg)), set()
        if self.anchored:
            self._start_compile(glob)

    def observe(self, update: ClientUpdate) -> None:
        """Keep a float32 device's lossless weights for training (copied: the strategy
        reuses its decode buffers); with the slice network, an integer device's received
        weights and their entry rungs too."""
        rnd = self._round
        if rnd is None:
            return
        if update.compute_bits < FLOAT_BITS:
            if update.kind != "weights" or not self.cfg.slices:
                return
            bits = tuple(grid_precision(w, self.cfg.clip) for w in update.weights)
            self._seen.update(b for b in bits if b in self.cfg.ladder[:-1])
            if not self.anchored and len(rnd.ints) < self.cfg.models_per_round:
                rnd.ints.append(([np.array(x, dtype=np.float32) for x in update.weights], bits))
            return
        if update.lossy or len(rnd.floats) >= self.cfg.models_per_round:
            return
        if update.kind == "delta":
            w = [np.add(g, np.asarray(d, np.float32).reshape(g.shape), dtype=np.float32)
                 for g, d in zip(rnd.glob, update.weights, strict=True)]
        else:
            w = [np.array(x, dtype=np.float32) for x in update.weights]
        rnd.floats.append(w)

    def __call__(self, update: ClientUpdate) -> ClientUpdate:
        """A low-bit device's weights, dequantized where the last finished version
        applies (new arrays; the input arrays are not modified)."""
        if update.compute_bits >= FLOAT_BITS or update.kind != "weights" or self._layout is None:
            return update
        version, tables = self._version, None
        if self.anchored:
            version, tables = self._round_tables()
        if version is None:
            self._count("fallback")
            self._count("passed")
            return update
        out = list(update.weights)
        changed = 0
        for i, w in enumerate(update.weights):
            bits = grid_precision(w, self.cfg.clip)
            if bits not in self.cfg.ladder[:-1] or not version.is_on(i, bits):
                self._count("layers_off")
                continue
            try:
                y = self._apply(version, tables, i, w, bits)
            except Exception as exc:  # noqa: BLE001 - never let the stage reject an update
                log.error("dequantizer v%d failed on layer %d of %s: %s; passed through",
                          version.number, i, update.device_id, exc)
                y = None
            # a table's outputs are finite by construction (make_tables, compile_tables); the
            # network's are checked
            if y is not None and not self._tabled(version, i, bits) and has_nonfinite(y.reshape(-1)):
                log.error("dequantizer v%d: non-finite output on layer %d of %s; passed through",
                          version.number, i, update.device_id)
                y = None
            if y is None:
                self._count("layers_off")
                continue
            out[i] = y.reshape(np.shape(w))
            changed += 1
            self._count("layers_on")
        self._count("updates" if changed else "passed")
        return replace(update, weights=out) if changed else update

    def _tabled(self, version, i: int, bits: int) -> bool:
        """Whether layer ``i`` entering at ``bits`` is looked up in a table."""
        if isinstance(version, SliceVersion):
            return self.anchored
        return version.table_for(self._layout, i, bits) is not None

    def _apply(self, version, tables, i: int, w: np.ndarray, bits: int) -> np.ndarray | None:
        if isinstance(version, SliceVersion):
            return dequantize_layer(version.net, self._layout, i, w, bits, tables)
        return version.dequantize(self._layout, i, w, bits)

    def end_round(self) -> dict[str, float | int]:
        """Close the round: its models join the pool, a training starts when none runs;
        returns the round's stats (see :meth:`stats`)."""
        if self._round is not None:
            self._pool.append(self._round)
            self._pool = self._pool[-self.cfg.pool_rounds:]
        stats = self.stats()
        self._round = None
        r = self._pool[-1].round_id if self._pool else 0
        if r - self._started >= self.cfg.train_every:
            self._put_in_use()
            self._start_training()
        return stats

    def _put_in_use(self) -> None:
        """The background training started ``train_every`` rounds ago, waited for and put
        in use (its version; None after a failure): the next round applies it."""
        t, self._thread = self._thread, None
        if t is None:
            return
        t.join()
        with self._lock:
            if self._trained:
                self._version = self._trained.pop()

    def stats(self) -> dict[str, float | int]:
        """``dequantizer_version`` (0: none), ``dequantizer_updates`` (low-bit updates
        dequantized), ``dequantizer_passed`` (passed through), ``dequantizer_fallback``
        (low-bit updates that came while no version was ready: plain dequantization),
        ``dequantizer_layers_on/off``, ``dequantizer_wait_s`` (the anchored form: seconds
        updates waited for the round's tables), ``dequantizer_failures`` (trainings that
        failed, in all), ``dequantizer_training`` (1 while one runs), and per layer i and
        entry bits b of the version in use ``dequantizer_on/i/intb`` (0/1) and
        ``dequantizer_l1_ratio/i/intb`` (held-out L1, dequantized / plain)."""
        v = self._version
        out: dict[str, float | int] = {f"dequantizer_{k}": n for k, n in self._counts.items()}
        out["dequantizer_version"] = v.number if v is not None else 0
        out["dequantizer_failures"] = self._failures
        out["dequantizer_training"] = int(self._thread is not None)
        if v is not None:
            for (i, b), (plain, deq) in v.heldout.items():
                out[f"dequantizer_on/{i}/int{b}"] = int(v.is_on(i, b))
                if plain > 0 and math.isfinite(deq):
                    out[f"dequantizer_l1_ratio/{i}/int{b}"] = deq / plain
        return out

    def _count(self, key: str, n: float = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + n

    # ------------------------------------------------------------------ the anchored form's tables
    def _start_compile(self, glob: list[np.ndarray]) -> None:
        """Compile the round's tables from the version in use, in the background."""
        self._compiled.clear()
        self._tables = None
        version = self._version
        if version is None or not isinstance(version, SliceVersion) or self._stop.is_set():
            self._compiled.set()
            return
        rungs = sorted(r for r in self._rungs if any(version.is_on(i, r) for i in range(len(glob))))
        layout = self._layout

        def work() -> None:
            try:
                tables = compile_tables(version.net, layout, glob, rungs)
                self._tables = (version, tables)
            except Exception:  # noqa: BLE001 - the round falls back to plain dequantization
                log.exception("dequantizer v%d: compiling the round's tables failed; plain dequantization",
                              version.number)
            finally:
                self._compiled.set()

        if not self.cfg.background:
            work()
            return
        self._compiler = threading.Thread(target=work, name=f"prowd-tables-{version.number}", daemon=True)
        self._compiler.start()

    def _round_tables(self):
        """(version, tables) of the round in progress (waiting for their compilation), or
        (None, None)."""
        if not self._compiled.is_set():
            t0 = time.perf_counter()
            self._compiled.wait()
            self._count("wait_s", time.perf_counter() - t0)
        got = self._tables
        return (None, None) if got is None else got

    # ------------------------------------------------------------------ training
    @property
    def version(self) -> Version | SliceVersion | None:
        """The last finished version (None: plain dequantization)."""
        return self._version

    @property
    def training(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a running training; True when none runs any more."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self.training

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop a running training (it ends at its next step) and start no other; the last
        finished version stays in use. Called at interpreter exit for every stage."""
        self._stop.set()
        self.wait(timeout)
        if self._compiler is not None:
            self._compiler.join(timeout)

    def _start_training(self) -> None:
        if self.training or self._layout is None or self._stop.is_set():
            return
        split = _slice_split(self._pool) if self.cfg.slices else _split([(r.round_id, r.models) for r in self._pool])
        if split is None:
            return
        number, self._next_number = self._next_number, self._next_number + 1
        self._started = self._pool[-1].round_id
        job = (split, number, self._pool[-1].round_id, self._layout, self._version)
        if not self.cfg.background:
            self._train(*job)
            if self._trained:
                self._version = self._trained.pop()
            return
        self._thread = threading.Thread(target=self._train, args=job, name=f"prowd-train-{number}", daemon=True)
        self._thread.start()

    def _train(self, split, number: int, round_id: int, layout, previous) -> None:
        """Train version ``number`` (warm-started from ``previous``) into ``_trained``; on
        any failure, log it and leave None there (plain dequantization)."""
        try:
            version = self.train_version(split[0], split[1], number, round_id, layout, previous)
        except TrainingStopped:
            log.info("dequantizer: training v%d stopped (closing)", number)
            return
        except Exception:  # noqa: BLE001 - the coordinator never dies of the dequantizer
            log.exception("dequantizer: training v%d failed; falling back to plain dequantization", number)
            with self._lock:
                self._failures += 1
                self._trained[:] = [None]
            return
        with self._lock:
            self._trained[:] = [version]
        _log_version(version)

    def train_version(self, train_models, heldout_models, number: int, round_id: int,
                      layout, previous=None):
        """Train a version on ``train_models``, judge it on ``heldout_models`` (block
        network: lists of float32 layers; slice network: :class:`Pair` s); ``previous``: a
        version to continue from."""
        t0 = time.perf_counter()
        if self.cfg.slices:
            net = (copy.deepcopy(previous.net) if isinstance(previous, SliceVersion)
                   else build_slice_net(self.cfg, self.cfg.seed))
            st = train_slices(net, self.cfg, layout, train_models, self._distillation(),
                              seed=self.cfg.seed + number, stop=self._stop)
            version = SliceVersion(number, round_id, self.cfg, net)
            version.heldout = slice_heldout_l1(net, layout, heldout_models, self._stop)
        else:
            net = copy.deepcopy(previous.net) if isinstance(previous, Version) else build_network(self.cfg, self.cfg.seed)
            st = train_network(net, self.cfg, layout, train_models, self._distillation(),
                               seed=self.cfg.seed + number, stop=self._stop)
            version = Version(number, round_id, self.cfg, net, make_tables(net, self.cfg))
            version.heldout = heldout_l1(version, layout, heldout_models, self._stop)
        version.gates = decide_gates(version.heldout, self.cfg.gate_margin)
        version.info = {"steps": st.steps, "blocks": st.blocks, "recon": st.recon, "distill": st.distill,
                        "train_seconds": st.seconds, "seconds": time.perf_counter() - t0,
                        "train_models": len(train_models), "heldout_models": len(heldout_models)}
        return version

    def _distillation(self) -> Distillation | None:
        if self.spec is None or self._buffer is None or self.cfg.lam <= 0:
            return None
        import torch

        from edge_client.intnn import alpha_shifts

        return Distillation(self.spec, [float(1 << a) for a in alpha_shifts(self.spec)],
                            torch.from_numpy(self._buffer))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """msgpack-able: the last finished version (or None), numbering, failures."""
        v = self._version
        return {"format": STATE_FORMAT, "network": self.cfg.network_key(), "next_number": self._next_number,
                "failures": self._failures, "version": None if v is None else v.to_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ProtocolError(f"dequantizer checkpoint: format {state.get('format')!r} != {STATE_FORMAT}")
        if state.get("network") != self.cfg.network_key():
            raise ConfigError(f"dequantizer checkpoint was made with {state.get('network')}, "
                              f"this dequantizer is {self.cfg.network_key()}")
        d = state.get("version")
        kind = SliceVersion if self.cfg.slices else Version
        version = None if d is None else kind.from_state(self.cfg, d)
        with self._lock:
            self._version = version
            self._next_number = int(state.get("next_number", 1))
            self._failures = int(state.get("failures", 0))


def _slice_split(pool: list[RoundData]):
    """(training pairs, held-out pairs) of the slice network: the float32 devices of older
    rounds with their globals plus every round's integer pairs vs the latest round's float32
    devices; with one round, all its floats but the last vs the last. None when nothing
    can be held out."""
    def floats(r: RoundData) -> list[Pair]:
        return [Pair(w, r.glob) for w in r.floats]

    ints = [Pair(r.glob, r.glob, x, bits) for r in pool for x, bits in r.ints]
    if len(pool) >= 2 and pool[-1].floats:
        return [p for r in pool[:-1] for p in floats(r)] + ints, floats(pool[-1])
    if pool and len(pool[-1].floats) >= 2:
        last = floats(pool[-1])
        return last[:-1] + ints, last[-1:]
    return None


def _split(pool: list[tuple[int, list[list[np.ndarray]]]]):
    """(training models, held-out models): older rounds vs the latest round; with one
    round, all its models but the last vs the last. None when nothing can be held out."""
    if len(pool) >= 2:
        return [m for _, ms in pool[:-1] for m in ms], list(pool[-1][1])
    if pool and len(pool[0][1]) >= 2:
        return list(pool[0][1][:-1]), [pool[0][1][-1]]
    return None


def _log_version(version: Version | SliceVersion) -> None:
    info = version.info
    log.info("dequantizer v%d ready (after round %d): %d steps on %d blocks of %d model(s), %.1f s",
             version.number, version.round_id, info.get("steps", 0), info.get("blocks", 0),
             info.get("train_models", 0), info.get("seconds", 0.0))
    for (i, b), (plain, deq) in sorted(version.heldout.items()):
        verdict = ("on" if version.is_on(i, b)
                   else "off: not better than plain dequantization, passes through unchanged")
        ratio = deq / plain if plain > 0 else float("nan")
        log.info("dequantizer v%d layer %d, Int%d input: held-out L1 %.3g plain -> %.3g (%.3f): %s",
                 version.number, i, b, plain, deq, ratio, verdict)
