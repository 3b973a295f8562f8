"""The documentation runs: every ```python block of README.md and docs/**/*.md, and every relative link between them.

Each page's blocks run in order in one subprocess (one namespace per page: a block may use what an earlier block of
its page defined), on the CPU, in a temporary working directory, with tracebacks that name the page and its line.
A block that cannot run here (a GPU, several processes, a download, a package merged later) has the line
`<!-- doctest: skip (reason) -->` right before its opening fence. docs/api.md must be what
scripts/gen_api_docs.py writes.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!-- doctest: skip \((.+)\) -->\s*$")
# Pages written on other branches at the same time as this test; a link to one is checked once the page exists.
def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """(first line of the code, code, skip reason or None) of every ```python block of `page`."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group(1) == "python":
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            skip = SKIP.match(prev)
            out.append((i + 2, "\n".join(lines[i + 1:j]), skip.group(1) if skip else None))
        i = j + 1
    return out


RUNNER = r"""
import sys, traceback, torch
torch.set_num_threads(1)
page = sys.argv[1]
for line, code in eval(sys.stdin.read()):
    try:
        exec(compile("\n" * (line - 1) + code, page, "exec"), globals())
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the block at {page}:{line}", file=sys.stderr)
        sys.exit(1)
"""


@pytest.mark.parametrize("page", [p for p in PAGES if any(s is None for _, _, s in blocks(p))], ids=rel)
def test_code_blocks_run(page, tmp_path):
    todo = [(line, code) for line, code, skip in blocks(page) if skip is None]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUNNER, rel(page)], input=repr(todo), text=True,
                          capture_output=True, cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, f"{rel(page)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_skips_give_a_reason():
    for page in PAGES:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            if "doctest:" in line:
                assert SKIP.match(line), f"{rel(page)}:{i}: write `<!-- doctest: skip (reason) -->`, got {line!r}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            s = slug(line.lstrip("#"))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def links(page: Path) -> list[tuple[int, str]]:
    out, in_code = [], False
    for i, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            out.append((i, m.group(1) or m.group(2)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_resolve(page):
    bad = []
    for line, target in links(page):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = rel(dest) if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            bad.append(f"{rel(page)}:{line}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(page)}:{line}: {target} (no heading #{anchor} in {where})")
    assert not bad, "\n".join(bad)


def test_generated_pages_are_current():
    """docs/api.md and the Note index of docs/design.md are what scripts/gen_api_docs.py writes."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_api_docs.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text and "make demo" in text
