"""The repository's documentation stays true to itself: nothing points outside the
repository, every ``docs/<file>.md`` a file names exists (with the section it names), every
link of the README and ``docs/`` resolves, and every ratio ``docs/benchmarks.md`` quotes is
one of ``benchmarks/results/latest.jsonl``'s."""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: what no file may mention: the design notes and papers outside the repository (the
#: strings are split so that this file does not mention them either)
OUTSIDE = ("../" + "shared", "/work/" + "shared", "DESIGN" + ".md", "ALGORITHMS" + ".md", "MQTT-NOTES" + ".md")
BINARY_SUFFIXES = {".png", ".onnx", ".msgpack", ".gz", ".whl", ".npz", ".pyc"}


def repository_files() -> list[Path]:
    """Tracked files and untracked ones git does not ignore (a plain walk without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        names = [n for n in out.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "runs", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis"}
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]
    return [ROOT / n for n in sorted(set(names)) if (ROOT / n).is_file()]


def text_files() -> list[tuple[Path, str]]:
    out = []
    for p in repository_files():
        if p.suffix in BINARY_SUFFIXES:
            continue
        try:
            out.append((p, p.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def test_nothing_points_outside_the_repository() -> None:
    bad = [(str(p.relative_to(ROOT)), i, s) for p, text in text_files()
           for i, line in enumerate(text.splitlines(), 1) for s in OUTSIDE if s in line]
    assert not bad, "point into docs/ instead: " + repr(bad[:20])


# --------------------------------------------------------------------------- headings and anchors

FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def headings(path: Path) -> tuple[list[str], set[str]]:
    """(the heading texts, their anchors, duplicates numbered as GitHub does)."""
    titles = [m.group(1).strip() for line in prose_lines(path.read_text(encoding="utf-8"))
              if (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line))]
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for t in titles:
        s = slug(t)
        anchors.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return titles, anchors


def test_slugs_follow_github() -> None:
    assert slug("4. Aggregation") == "4-aggregation"
    assert slug("`fedbit serve` with a job file") == "fedbit-serve-with-a-job-file"
    assert slug("paho-mqtt 2.x") == "paho-mqtt-2x"


def section_problem(target: Path, anchor: str) -> str | None:
    """Why ``anchor`` (``#slug`` or ``§N`` / ``§N-M``: numbered ``## N.`` headings) is not a
    section of ``target``, or None."""
    titles, anchors = headings(target)
    if anchor.startswith("#"):
        return None if anchor[1:] in anchors else f"no heading {anchor} (anchors: {sorted(anchors)})"
    lo, _, hi = anchor[1:].partition("-")
    numbers = {m.group(1) for t in titles if (m := re.match(r"(\d+)\.\s", t))}
    missing = [str(n) for n in range(int(lo), int(hi or lo) + 1) if str(n) not in numbers]
    return f"no section {', '.join(missing)}." if missing else None


# ``docs/<name>.md``, optionally followed by ``#anchor`` or `` §N`` / `` §N-M``
DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(#[\w-]+|\s§\d+(?:-\d+)?)?")


def test_every_docs_reference_names_an_existing_file_and_section() -> None:
    """Docstrings, comments, configs and docs say ``docs/algorithms.md §1`` or
    ``docs/architecture.md#failure-semantics``: the file and the section must exist."""
    refs = 0
    bad = []
    for p, text in text_files():
        for i, line in enumerate(text.splitlines(), 1):
            for m in DOC_REF.finditer(line):
                refs += 1
                where = f"{p.relative_to(ROOT)}:{i}: {m.group(0)}"
                target = DOCS / m.group(1)
                if not target.is_file():
                    bad.append(f"{where}: no such file")
                elif m.group(2) and (why := section_problem(target, m.group(2).strip())):
                    bad.append(f"{where}: {why}")
    assert refs > 40
    assert not bad, "\n".join(bad)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(md: Path) -> None:
    """Every relative link (and image) of the README and docs/ points at a file of the
    repository, and at a heading of it when it names one."""
    bad = []
    for line in prose_lines(md.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            url = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", url):  # https:, mailto:
                continue
            path, _, anchor = url.partition("#")
            target = (md.parent / path).resolve() if path else md
            if ROOT not in target.parents and target != ROOT:
                bad.append(f"{url}: outside the repository")
            elif not target.exists():
                bad.append(f"{url}: no such file")
            elif anchor and target.suffix == ".md" and (why := section_problem(target, "#" + anchor)):
                bad.append(f"{url}: {why}")
    assert not bad, f"{md.relative_to(ROOT)}: " + "; ".join(bad)


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A title\n\n## Two words\n")
    assert section_problem(tmp_path / "a.md", "#two-words") is None
    assert section_problem(tmp_path / "a.md", "#three-words") is not None
    assert section_problem(tmp_path / "a.md", "§1") is not None
    assert DOC_REF.search("see docs/algorithms.md §1-2 here").group(2) == " §1-2"
    assert [m.group(1) for m in LINK.finditer("[x](a.md#b) and ![i](p.png)")] == ["a.md#b", "p.png"]


# --------------------------------------------------------------------------- benchmark figures

def test_benchmark_ratios_come_from_latest_jsonl() -> None:
    """Each ratio in docs/benchmarks.md's table (``1.86``, ``0.46 / 0.50``) is a ratio of
    benchmarks/results/latest.jsonl, to the decimals shown."""
    ratios = [json.loads(line)["ratio"] for line in
              (ROOT / "benchmarks" / "results" / "latest.jsonl").read_text().splitlines() if line.strip()]
    rows = [line for line in (DOCS / "benchmarks.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]
    assert len(rows) >= 10
    bad = []
    for row in rows:
        cell = row.strip().strip("|").split("|")[-1]
        for num in re.findall(r"\d+(?:\.\d+)?", cell):
            tol = 0.5 * 10 ** -len(num.partition(".")[2]) + 1e-9
            if not any(abs(r - float(num)) <= tol for r in ratios):
                bad.append(f"{num} ({row[:60]}...)")
    assert not bad, "ratios not in latest.jsonl: " + "; ".join(bad)
