"""Where a run's files are, whichever command made the folder: ``fedbit serve --out DIR``
keeps the coordinator's files (``metrics.jsonl``, ``checkpoint.msgpack``, ``onnx/``,
``live.json``) in ``DIR`` itself; a ``fedbit emulate`` run folder keeps them in ``DIR/out``
(beside ``emulation.json``, the plots and ``summary.md``); a sweep folder holds one run
folder per combination and seed in ``runs/<combination>/seed-<k>/``.

:func:`find_run` takes any folder of these (a sub-folder such as ``onnx/`` or ``out/``
too) and says what it is; ``fedbit export``, ``report`` and ``status`` use it, and a
folder that holds several runs gets an error naming the run folders to pick from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_client.errors import ConfigError

#: files only a coordinator's run directory holds (any one of them marks it)
MARKERS = ("metrics.jsonl", "checkpoint.msgpack", "checkpoint.prev.msgpack", "round.msgpack", "live.json")
#: folders a run writes inside its own (a command given one means the run)
INSIDE_A_RUN = ("onnx", "inbox", "security", "broker", "devices", "tls")


@dataclass(frozen=True)
class RunFolder:
    """What a folder is: ``kind`` ``serve`` (a ``fedbit serve --out`` folder), ``emulated``
    (a ``fedbit emulate`` run folder) or ``sweep``; ``path`` the run (or sweep) folder
    itself; ``coordinator`` where its coordinator's files are (None for a sweep)."""

    kind: str
    path: Path
    coordinator: Path | None


def is_coordinator_dir(path: Path) -> bool:
    """Whether ``path`` holds a coordinator's run files."""
    return any((path / m).is_file() for m in MARKERS)


def _is_emulated(path: Path) -> bool:
    return (path / "emulation.json").is_file() or is_coordinator_dir(path / "out")


def sweep_runs(path: Path) -> list[Path]:
    """The run folders under ``path`` (a sweep folder, its ``runs/`` or one combination's
    folder), sorted."""
    found = [p for p in path.glob("seed-*") if p.is_dir() and _is_emulated(p)]
    found += [p for p in path.glob("*/seed-*") if p.is_dir() and _is_emulated(p)]
    found += [p for p in path.glob("runs/*/seed-*") if p.is_dir() and _is_emulated(p)]
    return sorted(set(found))


def find_run(path: str | Path) -> RunFolder:
    """What ``path`` is (see the module docstring); ConfigError naming ``path`` when it is
    no run folder, or when it holds several runs but is not their sweep folder (the error
    names run folders to pick). Nothing is created."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{p}: no such run folder")
    if p.name in INSIDE_A_RUN and p.parent != p and not is_coordinator_dir(p) and not _is_emulated(p):
        try:
            return find_run(p.parent)
        except ConfigError:
            pass
    if is_coordinator_dir(p):
        if p.name == "out" and (p.parent / "emulation.json").is_file():
            return RunFolder("emulated", p.parent, p)
        return RunFolder("serve", p, p)
    if _is_emulated(p):
        return RunFolder("emulated", p, p / "out")
    runs = sweep_runs(p)
    if (p / "results.json").is_file() or (runs and (p / "runs").is_dir()):
        return RunFolder("sweep", p, None)
    if runs:
        raise ConfigError(f"{p}: holds {len(runs)} runs of a sweep; pick one run folder "
                          f"({pick(runs)}), or give the sweep folder for all of them")
    raise ConfigError(f"{p}: not a run folder (no metrics.jsonl or checkpoint here or in {p / 'out'}: "
                      "a `fedbit serve --out` folder, a `fedbit emulate` run folder or a sweep folder)")


def pick(runs: list[Path], most: int = 3) -> str:
    """``a, b, c and 5 more`` of ``runs``."""
    more = f" and {len(runs) - most} more" if len(runs) > most else ""
    return ", ".join(str(r) for r in runs[:most]) + more


def coordinator_dir(path: str | Path) -> Path:
    """The coordinator's run directory of ``path`` (any folder :func:`find_run` takes);
    ConfigError naming ``path`` when it holds no single run: a sweep folder's names run
    folders to pick (``runs/<combination>/seed-<k>``)."""
    run = find_run(path)
    if run.coordinator is None:
        runs = sweep_runs(run.path)
        raise ConfigError(f"{run.path}: a sweep folder ({len(runs)} runs); this takes one run: "
                          f"{run.path / 'runs' / '<combination>' / 'seed-<k>'}"
                          + (f", e.g. {pick(runs)}" if runs else ""))
    return run.coordinator
