"""Where a run's files are, whichever command made the folder: ``fedbit serve --out DIR``
keeps the coordinator's files (``metrics.jsonl``, ``checkpoint.msgpack``, ``onnx/``,
``live.json``) in ``DIR`` itself; a ``fedbit emulate`` run folder keeps them in ``DIR/out``
(beside ``emulation.json``, the plots and ``summary.md``). ``fedbit export``, ``report``
and ``status`` take either."""

from __future__ import annotations

from pathlib import Path

from edge_client.errors import ConfigError

#: files only a coordinator's run directory holds (any one of them marks it)
MARKERS = ("metrics.jsonl", "checkpoint.msgpack", "checkpoint.prev.msgpack", "round.msgpack", "live.json")


def is_coordinator_dir(path: Path) -> bool:
    """Whether ``path`` holds a coordinator's run files."""
    return any((path / m).is_file() for m in MARKERS)


def coordinator_dir(path: str | Path) -> Path:
    """The coordinator's run directory of ``path`` (``path`` or ``path/out``); ConfigError
    naming ``path`` when neither holds a run (nothing is created)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{p}: no such run folder")
    for cand in (p, p / "out"):
        if is_coordinator_dir(cand):
            return cand
    raise ConfigError(f"{p}: not a run folder (no metrics.jsonl or checkpoint here or in {p / 'out'}: "
                      "a `fedbit serve --out` folder or a `fedbit emulate` run folder)")
