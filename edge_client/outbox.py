"""On-disk outbox for updates whose round is still open.

A device writes its encoded update here *before* publishing it and marks it *sent* once
the broker has PUBACKed it. What is still pending (the broker was away, the process was
killed) is re-sent after a reconnect while its round is open. A sent update is kept until
its round is over too: a broker that restarted without persistence, or a coordinator that
lost the record of it, gets it again when the round is announced again. Both are
discarded once the round is over (a newer round was announced, or the deadline passed).
The coordinator drops duplicates, so re-sending an update that did arrive is harmless.

Files: ``DIR/<round_id:08d>-<topic-id>.msgpack`` (pending) or ``.sent``, each holding the
exact payload bytes, written atomically (tmp + fsync + rename) so a crash never leaves
half an update.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OutboxItem:
    """A pending update: its round, the MQTT topic it goes to and its file."""

    round_id: int
    topic: str
    path: Path

    def payload(self) -> bytes:
        return self.path.read_bytes()


class Outbox:
    """A directory of pending updates (one per round; a newer write replaces it)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _name(round_id: int, topic: str) -> str:
        return f"{round_id:08d}-{topic.replace('/', '~')}.msgpack"

    def put(self, round_id: int, topic: str, payload: bytes) -> OutboxItem:
        """Persist ``payload`` for ``topic`` (durable before it returns)."""
        path = self.dir / self._name(round_id, topic)
        tmp = path.with_name("." + path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return OutboxItem(round_id, topic, path)

    def pending(self) -> list[OutboxItem]:
        """Pending items (not yet acknowledged), oldest round first."""
        return self._items(".msgpack")

    def sent(self) -> list[OutboxItem]:
        """Sent items (acknowledged by the broker, their round maybe still open)."""
        return self._items(".sent")

    def _items(self, suffix: str) -> list[OutboxItem]:
        items = []
        for p in sorted(self.dir.glob("*" + suffix)):
            head, _, rest = p.name.partition("-")
            try:
                r = int(head)
            except ValueError:
                continue
            items.append(OutboxItem(r, rest[: -len(suffix)].replace("~", "/"), p))
        return items

    def mark_sent(self, item: OutboxItem) -> OutboxItem:
        """The broker acknowledged ``item``: keep it, as sent, until its round closes."""
        path = item.path.with_suffix(".sent")
        try:
            os.replace(item.path, path)
        except FileNotFoundError:
            pass
        return OutboxItem(item.round_id, item.topic, path)

    def remove(self, item: OutboxItem) -> None:
        """Forget an item (acknowledged, or its round is closed)."""
        try:
            item.path.unlink()
        except FileNotFoundError:
            pass

    def discard_closed(self, open_round: int | None, *, keep_newer: bool = False) -> int:
        """Delete every item (pending or sent) whose round is not ``open_round`` (with
        ``keep_newer``, only those of older rounds: an older round announced again is not
        the end of a newer one); returns how many."""
        n = 0
        for item in self.pending() + self.sent():
            if item.round_id != open_round and not (keep_newer and open_round is not None
                                                    and item.round_id > open_round):
                self.remove(item)
                n += 1
        return n

    def __len__(self) -> int:
        return len(self.pending())
