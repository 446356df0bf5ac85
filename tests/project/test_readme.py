"""The README's commands, run for real.

A fenced shell block preceded by ``<!-- runnable; writes: FILE ... -->`` is run here, in
order, as a bash script in a temporary working directory holding a copy of
``examples/``, with this interpreter's ``bin`` (the project's venv) first on ``PATH``; it
must exit 0 and leave every file its marker names. Every command of an unmarked shell
block must be listed in :data:`NOT_RUN_HERE` with the reason and what covers it instead,
so a new command cannot slip into the README untested. And the README stays short.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 150
SHELL_INFO = {"sh", "bash", "shell", "console"}
MARKER = re.compile(r"^<!--\s*runnable(?:;\s*writes:\s*(?P<files>.*?))?\s*-->\s*$")

#: commands of the README that this test does not run: command -> why, and what runs it
NOT_RUN_HERE: dict[str, str] = {
    "make demo": "the README's contract itself; `fedbit demo` is run by tests/system/test_demo.py",
    "make test": "the README's contract itself: this suite",
    "make wheel": "needs the Makefile and writes dist/ in the checkout; tests/project/test_wheel.py builds "
                  "the same wheel and runs fedbit-edge from it",
    'python3 -m venv ~/fedbit && ~/fedbit/bin/pip install "fedbit-0.1.0-py3-none-any.whl[data]"':
        "on a device; make device-check (tools/device_check.sh) runs it on arm64 under qemu",
    "~/fedbit/bin/fedbit-edge warmup --profile raspberry-pi-4":
        "on a device; tests/packages/edge_client/test_cli.py runs `fedbit-edge warmup`, make device-check this line",
    "~/fedbit/bin/fedbit-edge doctor --profile raspberry-pi-4 --credentials pi-17.toml":
        "on a device with an enrolled broker; tests/packages/edge_client/test_device_tools.py runs doctor against a real one",
    "~/fedbit/bin/fedbit-edge run --credentials pi-17.toml --profile raspberry-pi-4 --data digits:1/4":
        "on a device with an enrolled broker; tests/packages/coordinator/test_security.py and make device-check run devices",
    "make install": "what make demo / make test do first",
    "fedbit serve --config examples/job.toml":
        "waits for devices; tests/packages/coordinator/test_job.py runs it from this file with two real devices",
}


@dataclass
class Block:
    line: int                 # 1-based line of the opening fence
    info: str                 # the fence's info string ("sh")
    text: str
    runnable: bool
    writes: list[str]

    def commands(self) -> list[str]:
        """The block's commands: continuation lines joined, comments and blanks dropped."""
        out, cur = [], ""
        for raw in self.text.splitlines():
            line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
            if cur:
                line = cur + " " + line.strip()
                cur = ""
            if line.endswith("\\"):
                cur = line[:-1].rstrip()
                continue
            if line.strip():
                out.append(" ".join(line.split()))
        return out


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, with the runnable marker of the line before."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)", lines[i])
        if not m:
            i += 1
            continue
        start, info = i, m.group(1).lower()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        assert j < len(lines), f"README line {start + 1}: unclosed fence"
        marker = MARKER.match(lines[start - 1].strip()) if start else None
        blocks.append(Block(start + 1, info, "\n".join(lines[start + 1:j]), marker is not None,
                            (marker.group("files") or "").split() if marker else []))
        i = j + 1
    return blocks


BLOCKS = readme_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_is_short() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES}: move details into docs/"


def test_every_shell_command_is_run_here_or_listed_with_its_reason() -> None:
    shell = [b for b in BLOCKS if b.info in SHELL_INFO]
    marked = [b for b in BLOCKS if b.runnable]
    assert all(b.info in SHELL_INFO for b in marked), "a runnable marker before a non-shell block"
    assert not [b.line for b in BLOCKS if not b.info], "a fence without a language: say sh or text"
    unlisted = [(b.line, c) for b in shell if not b.runnable for c in b.commands() if c not in NOT_RUN_HERE]
    assert not unlisted, f"README commands neither runnable nor in NOT_RUN_HERE: {unlisted}"
    listed = {c for b in shell if not b.runnable for c in b.commands()}
    assert not set(NOT_RUN_HERE) - listed, f"stale NOT_RUN_HERE entries: {set(NOT_RUN_HERE) - listed}"
    assert sum(len(b.commands()) for b in marked) >= 4


def test_the_block_parser(tmp_path: Path) -> None:
    blocks = readme_blocks("<!-- runnable; writes: a b -->\n```sh\nx --y \\\n  z   # c\n\n# only\n```\n"
                           "```text\nout\n```\n```sh\nw\n```\n")
    assert [(b.info, b.runnable, b.writes, b.commands()) for b in blocks] == [
        ("sh", True, ["a", "b"], ["x --y z"]), ("text", False, [], ["out"]), ("sh", False, [], ["w"])]


@pytest.mark.slow
def test_the_runnable_readme_blocks_run_and_write_their_files(tmp_path: Path) -> None:
    """The quick start as a newcomer types it: each marked block in one working directory,
    in order, as real subprocesses."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(ROOT / "examples", work / "examples")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    marked = [b for b in BLOCKS if b.runnable]
    assert marked
    for b in marked:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", b.text], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"README block at line {b.line} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        missing = [f for f in b.writes if not (work / f).is_file() or (work / f).stat().st_size == 0]
        assert not missing, f"README block at line {b.line} did not write {missing}"
        if "fedbit-edge predict" in b.text:  # "prints the accuracy (JSON)": of a trained model
            acc = [json.loads(line)["accuracy"] for line in proc.stdout.splitlines() if line.startswith("{")]
            assert acc and all(a > 0.3 for a in acc), proc.stdout  # chance is 0.1
    # what the README says the quick start prints: a comparison of both strategies, an accuracy
    summary = (work / "runs" / "quickstart" / "summary.md").read_text()
    assert "strategy=fedavg" in summary and "strategy=fedshift" in summary
    rows = (work / "pred.csv").read_text().splitlines()
    assert rows[0] == "index,prediction,label" and len(rows) == 361
