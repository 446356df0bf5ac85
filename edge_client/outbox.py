"""On-disk outbox for updates that are not yet acknowledged by the broker.

A device writes its encoded update here *before* publishing it and deletes it once the
broker has PUBACKed it. What is left (the broker was away, the process was killed) is
re-sent after a reconnect while its round is still open, and discarded once the round is
over (a newer round was announced, or the deadline passed). The coordinator drops
duplicates, so re-sending an update that did arrive is harmless.

Files: ``DIR/<round_id:08d>-<topic-id>.msgpack``, each holding the exact payload bytes,
written atomically (tmp + fsync + rename) so a crash never leaves half an update.
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
        """Pending items, oldest round first."""
        items = []
        for p in sorted(self.dir.glob("*.msgpack")):
            head, _, rest = p.name.partition("-")
            try:
                r = int(head)
            except ValueError:
                continue
            items.append(OutboxItem(r, rest[: -len(".msgpack")].replace("~", "/"), p))
        return items

    def remove(self, item: OutboxItem) -> None:
        """Forget an item (acknowledged, or its round is closed)."""
        try:
            item.path.unlink()
        except FileNotFoundError:
            pass

    def discard_closed(self, open_round: int | None) -> int:
        """Delete every item whose round is not ``open_round``; returns how many."""
        n = 0
        for item in self.pending():
            if item.round_id != open_round:
                self.remove(item)
                n += 1
        return n

    def __len__(self) -> int:
        return len(self.pending())
