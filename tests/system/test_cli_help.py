"""Every subcommand of ``fedbit`` and ``fedbit-edge`` has a description on its own
``--help`` page and a line in the command list, and every option and argument has help
text."""

from __future__ import annotations

import argparse
import re

import pytest


def _parsers(parser: argparse.ArgumentParser, path: str):
    """``(path, parser, help in the parent's list)`` of every (sub)command, recursively."""
    yield path, parser, None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                for p, parser2, _ in _parsers(sub, f"{path} {name}"):
                    yield p, parser2, listed.get(name) if p == f"{path} {name}" else None


def _missing(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    missing = []
    for path, p, listed in _parsers(parser, prog):
        if path != prog:
            if not (listed or "").strip():
                missing.append(f"{path}: no line in the command list")
            if not (p.description or "").strip():
                missing.append(f"{path}: no description on its --help page")
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            words = re.sub(r"\(default:? [^)]*\)", "", a.help or "").strip()  # more than its default
            if not words or a.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}: no help text")
    return missing


@pytest.mark.parametrize("prog", ["fedbit", "fedbit-edge"])
def test_every_subcommand_and_option_has_help_text(prog: str) -> None:
    if prog == "fedbit":
        from coordinator.cli import build_parser
    else:
        from edge_client.cli import build_parser
    assert _missing(build_parser(), prog) == []


def test_the_example_files_list_every_bundled_model() -> None:
    from pathlib import Path

    from firmware_models import MODELS

    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("job.toml", "quickstart.toml"):
        line = next(ln for ln in (root / name).read_text().splitlines() if ln.startswith("model = "))
        listed = line.split("#", 1)[1].split(",")[0].split("|")
        assert sorted(m.strip() for m in listed) == sorted(MODELS), (name, line)


def test_the_docs_name_the_extras_make_install_installs() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extras = re.search(r"^EXTRAS \?= (\S+)$", (root / "Makefile").read_text(), re.M).group(1)
    for doc in ("README.md", "docs/operations.md"):
        said = re.findall(r"make install\s+# \.venv with fedbit\[([^\]]+)\]", (root / doc).read_text())
        assert said and all(sorted(s.split(",")) == sorted(extras.split(",")) for s in said), (doc, said, extras)
