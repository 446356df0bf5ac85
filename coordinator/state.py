"""Durable coordinator state: atomic checkpoints, the round plan, the inbox, metrics.

Under the run directory ``DIR`` (``fedbit serve --out DIR``; files 0600, ``inbox/`` 0700)::

    DIR/checkpoint.msgpack      last completed round: weights, strategy + RNG state, metrics
    DIR/round.msgpack           the plan of the round in progress (selected, deadline, ...)
    DIR/devices.msgpack         the device registry (every hello), rewritten when it changes
    DIR/inbox/r000007.log       round 7's raw updates, append-only (``r000007.<tag>.log``: a worker's)
    DIR/metrics.jsonl           one JSON object per completed round

Every file but the inbox is written atomically and framed with a 64-bit checksum (a damaged
one raises :class:`CorruptFile`, never loads); the inbox is a log of checksummed records,
synced before its updates are acknowledged. What survives which crash and how a resumed
run replays: docs/architecture.md#failure-semantics. Arrays are stored as ``{"shape",
"dtype", "data"}`` maps (little-endian), msgpack-framed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from coordinator.checksum import checksum
from edge_client.errors import ConfigError

STATE_VERSION = 1
#: framing of every atomically written file: magic, checksum of the body, body length
_FILE_MAGIC, _FILE_HEAD = b"FBS1", struct.Struct("<4sQQ")
log = logging.getLogger("fedbit.state")


class CorruptFile(ConfigError):
    """A state file that fails its checksum or cannot be parsed; ``path`` names it."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path


def frame(body: bytes) -> bytes:
    """``body`` with its checksum header (what :func:`unframe` checks)."""
    return _FILE_HEAD.pack(_FILE_MAGIC, checksum(body), len(body)) + body


def unframe(data: bytes, path: Path) -> bytes:
    """The body of a framed file (CorruptFile when truncated or damaged). A file without
    the frame (written before it existed) is returned as is; its parser judges it."""
    if data[:4] != _FILE_MAGIC:
        return data
    if len(data) < _FILE_HEAD.size:
        raise CorruptFile(path, f"truncated ({len(data)} bytes, shorter than its header)")
    _, stored, n = _FILE_HEAD.unpack_from(data)
    body = memoryview(data)[_FILE_HEAD.size:]
    if len(body) != n:
        raise CorruptFile(path, f"truncated or extended: {len(body)} body bytes, the header says {n}")
    if checksum(body) != stored:
        raise CorruptFile(path, "fails its checksum (damaged on disk)")
    return bytes(body)
#: inbox record header: magic, payload length, checksum(id then payload), id length
_MAGIC, _HEAD = b"FBU2", struct.Struct("<4sIQH")
#: record formats by magic: header layout, checksum of (device id, payload). FBU1 (CRC-32)
#: is the previous format, still read so that a log written by it replays.
_RECORD_FORMATS = {
    _MAGIC: (_HEAD, lambda did, payload: checksum(payload, checksum(did))),
    b"FBU1": (struct.Struct("<4sIIH"), lambda did, payload: zlib.crc32(payload, zlib.crc32(did))),
}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: the mode of every file of a run directory: updates, models and device lists are the
#: operator's alone (other local users read none of them)
FILE_MODE = 0o600


def private_opener(path: str, flags: int) -> int:
    """``open(..., opener=private_opener)``: a file created :data:`FILE_MODE` from the
    start (never briefly readable by others, whatever the umask)."""
    fd = os.open(path, flags, FILE_MODE)
    if flags & os.O_CREAT:
        os.fchmod(fd, FILE_MODE)
    return fd


def atomic_write(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically (tmp + fsync + rename + dir fsync), mode
    :data:`FILE_MODE`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb", opener=private_opener) as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def pack_array(a: np.ndarray) -> dict[str, Any]:
    """An array as a msgpack-able map (little-endian bytes)."""
    a = np.ascontiguousarray(a)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    return {"shape": list(a.shape), "dtype": dt.str, "data": a.astype(dt, copy=False).tobytes()}


def unpack_array(d: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`pack_array` (a writable copy)."""
    return np.frombuffer(d["data"], dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"__nd__": pack_array(obj)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _hook(obj: dict[str, Any]) -> Any:
    if "__nd__" in obj and len(obj) == 1:
        return unpack_array(obj["__nd__"])
    return obj


def dumps(obj: Any) -> bytes:
    """msgpack with numpy arrays (used for checkpoints and strategy state)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=False)


def loads(data: bytes) -> Any:
    """Inverse of :func:`dumps` (map keys may be ints, as strategy states use bitwidths)."""
    return msgpack.unpackb(data, object_hook=_hook, raw=False, strict_map_key=False)


@dataclass
class Checkpoint:
    """Everything needed to continue after round ``completed_round``.

    - ``weights``: global shared-domain weights, float32, shapes of the model spec;
    - ``group_weights``: per-bitwidth weights from grouped strategies ({bits: weights});
    - ``strategy_state``: ``Strategy.state_dict()``;
    - ``rng_state``: the selection RNG (``numpy.random.Generator.bit_generator.state``);
    - ``metrics``: the metrics record of ``completed_round`` (for repairing metrics.jsonl);
    - ``devices``: the hello registry ({device_id: hello fields}) as checkpoints held it
      before it got its own file (``devices.msgpack``, written when it changes); read on
      resume only when that file is missing.
    """

    job: str
    model: str
    completed_round: int
    weights: list[np.ndarray]
    group_weights: dict[int, list[np.ndarray]] = field(default_factory=dict)
    strategy_state: dict[str, Any] = field(default_factory=dict)
    rng_state: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundPlan:
    """The round in progress, saved before it is announced.

    ``deadline`` is a Unix time (s); ``variants`` maps variant name to model digest;
    ``selected`` is sorted. Buffered mode saves one before every announcement: ``round_id``
    the model version, ``tickets`` each open request's number by device (``selected``
    those devices) and ``last_ticket`` the highest number issued.
    """

    round_id: int
    selected: list[str]
    deadline: float
    variants: dict[str, str]
    hparams: dict[str, Any] = field(default_factory=dict)
    started_at: float = 0.0
    #: the selection RNG state after this round's draw (JSON), so a resumed run selects
    #: exactly as an uninterrupted one would
    rng_state: str = ""
    tickets: dict[str, int] = field(default_factory=dict)
    last_ticket: int = 0


class RunState:
    """The files of one run directory (see the module docstring).

    ``damaged`` lists what :meth:`inbox_items` found damaged (messages naming the file,
    offset and record), for the caller's log and metrics. ``inbox_tag``: this process
    appends to ``r<round>.<tag>.log`` (an ingest worker; the round loop's own log has
    none); :meth:`inbox_items` reads every process's log of a round.
    """

    def __init__(self, out_dir: str | Path, *, durable: bool = True, inbox_tag: str = "") -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.checkpoint_path = self.dir / "checkpoint.msgpack"
        self.checkpoint_prev_path = self.dir / "checkpoint.prev.msgpack"
        self.plan_path = self.dir / "round.msgpack"
        self.plan_prev_path = self.dir / "round.prev.msgpack"
        self.damaged: list[str] = []
        self.devices_path = self.dir / "devices.msgpack"
        self.inbox_dir = self.dir / "inbox"
        self.metrics_path = self.dir / "metrics.jsonl"
        self.inbox_dir.mkdir(mode=0o700, exist_ok=True)
        self.inbox_tag = inbox_tag
        self._log: int | None = None  # raw fd of the open round's log (O_APPEND)
        self._log_round: int | None = None
        self._appended = 0  # records appended to the open log ...
        self._synced = 0  # ... and how many of them a sync has covered
        self._dir_dirty = False  # the open log was created and its directory not synced
        self._sync_lock = threading.Lock()

    # ------------------------------------------------------------------ checkpoint

    def has_run(self) -> bool:
        """Whether the directory holds a previous run (a checkpoint or a round plan)."""
        return any(p.exists() for p in (self.checkpoint_path, self.checkpoint_prev_path,
                                        self.plan_path, self.plan_prev_path))

    def _rotate(self, path: Path, prev: Path) -> None:
        """Keep ``path``'s current version as ``prev`` (made durable by the atomic write
        that follows, which syncs the directory)."""
        if path.exists():
            os.replace(path, prev)

    def save_checkpoint(self, ckpt: Checkpoint) -> None:
        """Write the checkpoint (framed, atomically); the one it replaces becomes
        ``checkpoint.prev.msgpack``. (A crash between the two leaves no current
        checkpoint: :meth:`load_checkpoint` then reads the previous one.)"""
        body = {f.name: getattr(ckpt, f.name) for f in fields(ckpt)}  # no deep copy of the weights
        body["state_version"] = STATE_VERSION
        body["group_weights"] = {int(k): v for k, v in ckpt.group_weights.items()}
        data = frame(dumps(body))
        self._rotate(self.checkpoint_path, self.checkpoint_prev_path)
        atomic_write(self.checkpoint_path, data, durable=self.durable)

    def load_checkpoint(self, *, previous: bool = False) -> Checkpoint | None:
        """The last checkpoint (``previous``: the one before it), or None when there is
        none; :class:`CorruptFile` when it is truncated, damaged or unreadable."""
        path = self.checkpoint_prev_path if previous else self.checkpoint_path
        if not previous and not path.exists() and self.checkpoint_prev_path.exists():
            path = self.checkpoint_prev_path  # killed between the rotation and the write
        if not path.exists():
            return None
        body = self._read(path, "checkpoint")
        try:
            if not isinstance(body, dict) or body.pop("state_version", None) != STATE_VERSION:
                raise CorruptFile(path, "unsupported state version")
            body["group_weights"] = {int(k): v for k, v in body.get("group_weights", {}).items()}
            return Checkpoint(**body)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptFile(path, f"unreadable checkpoint ({exc})") from None

    @staticmethod
    def _read(path: Path, what: str) -> Any:
        """A framed msgpack file's content (CorruptFile naming ``path``)."""
        data = unframe(path.read_bytes(), path)
        try:
            return loads(data)
        except Exception as exc:  # noqa: BLE001 - msgpack raises many types
            raise CorruptFile(path, f"unreadable {what} ({type(exc).__name__}: {exc})") from None

    # ------------------------------------------------------------------ device registry

    def save_devices(self, devices: dict[str, dict[str, Any]]) -> None:
        """The coordinator's device registry (hello fields by device id), atomically; written
        when it changed, not with every checkpoint (a fleet of 10,000 is ~1.5 MB)."""
        atomic_write(self.devices_path, frame(dumps(devices)), durable=self.durable)

    def load_devices(self) -> dict[str, dict[str, Any]]:
        """The saved registry ({} when none; CorruptFile when damaged)."""
        if not self.devices_path.exists():
            return {}
        devices = self._read(self.devices_path, "device registry")
        if not isinstance(devices, dict):
            raise CorruptFile(self.devices_path, f"unreadable device registry (a {type(devices).__name__})")
        return devices

    # ------------------------------------------------------------------ round plan

    def save_plan(self, plan: RoundPlan) -> None:
        """Write the plan; a plan of another round it replaces becomes
        ``round.prev.msgpack``."""
        data = frame(dumps(asdict(plan)))
        try:
            current = self.load_plan()
        except CorruptFile:
            current = None
        if current is not None and current.round_id != plan.round_id:
            self._rotate(self.plan_path, self.plan_prev_path)
        atomic_write(self.plan_path, data, durable=self.durable)

    def load_plan(self, *, previous: bool = False) -> RoundPlan | None:
        """The plan of the round in progress (``previous``: of the round before it), None
        when there is none; :class:`CorruptFile` when it is damaged."""
        path = self.plan_prev_path if previous else self.plan_path
        if not path.exists():
            return None
        body = self._read(path, "round plan")
        try:
            return RoundPlan(**body)
        except (ValueError, TypeError) as exc:
            raise CorruptFile(path, f"unreadable round plan ({exc})") from None

    # ------------------------------------------------------------------ inbox

    def _round_log(self, round_id: int, tag: str | None = None) -> Path:
        tag = self.inbox_tag if tag is None else tag
        return self.inbox_dir / (f"r{round_id:06d}.{tag}.log" if tag else f"r{round_id:06d}.log")

    def _round_logs(self, round_id: int) -> list[Path]:
        """Every log of round ``round_id``: the round loop's first, then the others by name."""
        main = self._round_log(round_id, "")
        return ([main] if main.exists() else []) + sorted(self.inbox_dir.glob(f"r{round_id:06d}.*.log"))

    def inbox_append(self, round_id: int, device_id: str, payload: bytes) -> None:
        """Append an update's received bytes to the round's log, *not yet durable*: call
        :meth:`inbox_sync` before acknowledging it (group commit: one sync per batch).

        One ``os.writev`` of the record header and the payload as received (no copy, no
        re-encoding). :meth:`inbox_sync` may run meanwhile in another thread (the
        coordinator's committer); appends themselves come from one thread.
        """
        if self._log_round != round_id:
            self._close_log()
            path = self._round_log(round_id)
            created = not path.exists()
            self._log = private_opener(str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            self._log_round = round_id
            # the new log's directory entry is made durable by the next inbox_sync
            self._dir_dirty = created
        did = device_id.encode()
        head = _HEAD.pack(_MAGIC, len(payload), checksum(payload, checksum(did)), len(did))
        assert self._log is not None
        parts = [head + did, payload]
        want = len(parts[0]) + len(payload)
        n = os.writev(self._log, parts)
        if n != want:  # a short write (disk full, signal): finish it or fail loudly
            rest = memoryview(b"".join(parts))[n:]
            while rest:
                k = os.write(self._log, rest)
                if k <= 0:
                    raise OSError(f"inbox: short write to {self._round_log(round_id)}")
                rest = rest[k:]
        self._appended += 1

    def inbox_sync(self) -> None:
        """Make every update appended so far durable (one ``fdatasync``, plus one of the
        inbox directory after a log was created; thread-safe)."""
        with self._sync_lock:
            if self._log is None:
                return
            seq = self._appended
            if self._synced >= seq:
                return
            if self.durable:
                os.fdatasync(self._log)
                if self._dir_dirty:
                    _fsync_dir(self.inbox_dir)
            self._dir_dirty = False
            self._synced = seq

    def inbox_put(self, round_id: int, device_id: str, payload: bytes) -> None:
        """Append and sync one update."""
        self.inbox_append(round_id, device_id, payload)
        self.inbox_sync()

    def _close_log(self) -> None:
        if self._log is not None:
            self.inbox_sync()
            with self._sync_lock:
                os.close(self._log)
                self._log, self._log_round = None, None
                self._appended = self._synced = 0
        self._log_round = None

    @staticmethod
    def _record(data: bytes, pos: int) -> tuple[int, bytes, bytes] | None:
        """The record starting at ``pos``: (its end, device id, payload), or None when the
        bytes there are not one whole record whose checksum holds."""
        fmt = _RECORD_FORMATS.get(bytes(data[pos:pos + 4]))
        if fmt is None or pos + fmt[0].size > len(data):
            return None
        head, record_sum = fmt
        _, n, stored, idn = head.unpack_from(data, pos)
        start = pos + head.size
        end = start + idn + n
        if end > len(data):
            return None
        did, payload = data[start:start + idn], data[start + idn:end]
        return (end, did, payload) if record_sum(did, payload) == stored else None

    def _next_record(self, data: bytes, pos: int) -> int | None:
        """Where the next whole record after ``pos`` starts (a scan for a record magic
        whose record checks out), None when none does."""
        i = pos
        while True:
            i = data.find(b"FBU", i + 1)
            if i < 0:
                return None
            if self._record(data, i) is not None:
                return i

    def inbox_items(self, round_id: int, tag: str | None = None, *, unique: bool = True) -> list[tuple[str, bytes]]:
        """``(device_id, payload)`` persisted for ``round_id`` (by every process, or only
        by the one appending under ``tag``), in arrival order; the first record of a
        device wins (``unique=False``: every record, for a buffer that may hold several
        updates of one device). Bytes that are not a whole record are skipped and
        reported (``damaged``, the log): at the log's tail, a write torn by a crash (never
        acknowledged: re-sent); inside it, a damaged record (its device re-sends when the
        round is announced again); the records after it still count."""
        if self._log_round == round_id:
            self.inbox_sync()
        paths = self._round_logs(round_id) if tag is None else [self._round_log(round_id, tag)]
        out: list[tuple[str, bytes]] = []
        seen: set[str] = set()
        for path in paths:
            if path.exists():
                self._read_log(path, out, seen, unique)
        return out

    def _read_log(self, path: Path, out: list[tuple[str, bytes]], seen: set[str], unique: bool = True) -> None:
        data = path.read_bytes()
        pos, index = 0, 0
        while pos < len(data):
            rec = self._record(data, pos)
            if rec is None:
                nxt = self._next_record(data, pos)
                end = len(data) if nxt is None else nxt
                what = ("a torn write at the log's end (a crash before its sync: never acknowledged)"
                        if nxt is None else "a damaged record: skipped")
                msg = f"{path}: bytes {pos}..{end} (record {index}) fail their length or checksum: {what}"
                self.damaged.append(msg)
                (log.warning if nxt is None else log.error)(msg)
                if nxt is None:
                    break
                pos, index = nxt, index + 1
                continue
            end, did, payload = rec
            dev = did.decode(errors="replace")
            if dev not in seen or not unique:
                seen.add(dev)
                out.append((dev, payload))
            pos, index = end, index + 1

    def inbox_has(self, round_id: int, device_id: str) -> bool:
        return any(d == device_id for d, _ in self.inbox_items(round_id))

    def inbox_prune(self, keep_from: int) -> None:
        """Delete the inbox of every round < ``keep_from`` (completed and checkpointed)."""
        if self._log_round is not None and self._log_round < keep_from:
            self._close_log()
        for path in self.inbox_dir.glob("r*.log"):
            try:
                r = int(path.name[1:].split(".", 1)[0])
            except ValueError:
                continue
            if r < keep_from:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ metrics

    def append_metrics(self, record: dict[str, Any]) -> None:
        """Append one JSON line and fsync (one line per completed round). A non-finite
        float anywhere in ``record`` (a group scored on validation only has a NaN test
        accuracy; an exploded model a NaN loss) is written as ``null``: strict JSON, and no
        round is lost to a figure that could not be computed."""
        line = json.dumps(_finite_json(record), sort_keys=True, allow_nan=False) + "\n"
        with open(self.metrics_path, "a", encoding="utf-8", opener=private_opener) as f:
            f.write(line)
            f.flush()
            if self.durable:
                os.fsync(f.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        out = []
        for line in self.metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
        return out

    def repair_metrics(self, ckpt: Checkpoint | None) -> None:
        """Make metrics.jsonl hold exactly one line per round 1..completed_round.

        A crash between the checkpoint and the metrics append loses the last line (it is
        restored from the checkpoint); lines of rounds past the checkpoint are dropped.
        """
        completed = ckpt.completed_round if ckpt else 0
        by_round: dict[int, dict[str, Any]] = {}
        for rec in self.read_metrics():
            r = rec.get("round")
            if isinstance(r, int) and 1 <= r <= completed and r not in by_round:
                by_round[r] = rec
        if ckpt and ckpt.metrics and completed not in by_round:
            by_round[completed] = ckpt.metrics
        text = "".join(json.dumps(by_round[r], sort_keys=True) + "\n" for r in sorted(by_round))
        atomic_write(self.metrics_path, text.encode(), durable=self.durable)


def _finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-Inf) in its dicts, lists and tuples
    replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value
