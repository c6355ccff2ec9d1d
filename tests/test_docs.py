"""README.md and docs/*.md stay true: their relative links resolve and their runnable blocks run.

Links: every ``[text](target)`` outside code whose target is not a URL must name a file that
exists (relative to the page), and a ``#anchor`` must be the GitHub-style slug of a heading in
that file (or in the page itself for a bare ``#anchor``).

The runnable-block convention: a fenced block whose info string is ``python run`` or
``bash run`` is run by this test; a block with any other info string (``python``, ``bash``,
``yaml``, none) is shown, not run, and is kept correct by reading the code. GitHub highlights
``python run`` as Python (it reads the first word). A runnable block must

- take seconds on 2 CPU cores (a block that trains runs a handful of steps of a tiny model on
  CPU processes with gloo),
- download nothing, and
- write only into its working directory.

A ``python run`` block is saved as ``example.py`` in a fresh temporary directory and run there
with ``python example.py`` (so a ``Trainer`` may launch its ranks by running the script again);
a ``bash run`` block runs with ``bash -e`` from the repository root, with the interpreter
running this test first on ``PATH`` as ``python``. Both see this checkout first on
``PYTHONPATH`` and get ``DAPPLE_DOCS_TMP``, a fresh temporary directory to write into.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RUNNABLE = {"python run", "bash run"}
TIMEOUT_S = 300

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    info: str
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def split_fences(text: str) -> tuple[list[str], list[Block]]:
    """The page's lines outside fenced blocks (blanked inside) and its fenced blocks."""
    prose: list[str] = []
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            prose.append(lines[i])
            i += 1
            continue
        fence, indent, start = match["fence"], len(match["indent"]), i
        body: list[str] = []
        i += 1
        closing = re.compile(re.escape(fence[0]) + f"{{{len(fence)},}}")
        while i < len(lines) and not closing.fullmatch(lines[i].strip()):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append(Block(Path(), start + 1, match["info"].strip(), "\n".join(body) + "\n"))
        prose.extend([""] * (i - start + 1))
        i += 1
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose, _ = split_fences(page.read_text())
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match["text"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    prose, _ = split_fences(page.read_text())
    found = []
    for number, line in enumerate(prose, start=1):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match["target"].strip("<>")))
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: {target!r}"
        if not file.exists():
            problems.append(f"{where}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            problems.append(f"{where}: no heading with anchor #{anchor} in {file.relative_to(root)}")
    return problems


def runnable_blocks() -> list[Block]:
    found = []
    for page in PAGES:
        _, blocks = split_fences(page.read_text())
        found += [Block(page, b.line, b.info, b.code) for b in blocks if b.info in RUNNABLE]
    return found


def test_pages_exist() -> None:
    assert (ROOT / "README.md") in PAGES and len(PAGES) > 2, f"expected README.md and docs/*.md, found {PAGES}"


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines; keep it at most 250 and move detail to a page under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert links(page) or page.name == "benchmarks.md", (
        f"{page.relative_to(ROOT)} links nowhere: does LINK still parse?"
    )
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slug_matches_github() -> None:
    assert slug("Memory: predicted vs measured peak per rank") == "memory-predicted-vs-measured-peak-per-rank"
    assert slug("ZB-H2 (`zb-h2`): memory for slack, 15:00 UTC") == "zb-h2-zb-h2-memory-for-slack-1500-utc"
    assert slug("What works, what is refused") == "what-works-what-is-refused"


def test_link_checker_catches_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [gone](missing.md) [no heading](#nowhere)\n\n```md\n[in code](x.md)\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2 and "missing.md" in problems[0] and "#nowhere" in problems[1], problems


def test_every_page_but_benchmarks_opens_with_a_runnable_or_marked_example() -> None:
    """Each docs page opens with an example: its first fenced block comes before its second heading."""
    missing = []
    for page in PAGES:
        if page.name in ("README.md", "benchmarks.md"):
            continue
        text = page.read_text()
        first_fence = text.find("```")
        headings = [m.start() for m in re.finditer(r"^#{1,6} ", text, re.MULTILINE)]
        if first_fence < 0 or (len(headings) > 1 and first_fence > headings[1]):
            missing.append(str(page.relative_to(ROOT)))
    assert not missing, f"pages without an opening example (a fenced block before the second heading): {missing}"


@pytest.mark.parametrize("block", runnable_blocks(), ids=str)
def test_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["DAPPLE_DOCS_TMP"] = str(tmp_path)
    if block.info == "python run":
        script = tmp_path / "example.py"
        script.write_text(block.code)
        command, cwd = [sys.executable, str(script)], tmp_path
    else:
        command, cwd = ["bash", "-e", "-c", block.code], ROOT
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"the runnable block at {block} exited with {result.returncode}:\n{block.code}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
