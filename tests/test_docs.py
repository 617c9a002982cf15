"""The README and docs/ stay true: links and anchors resolve, every repository path, ``make`` target,
config, ``tools/*.py`` flag and dotted ``mcore_engine`` name they mention exists."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]


def _slug(heading: str) -> str:
    heading = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return heading.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors (``-1``, ``-2`` for repeats); code blocks hold no headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = _slug(heading)
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@cache
def _help(tool: str) -> str:
    out = subprocess.run([sys.executable, tool, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    return out.stdout + out.stderr


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_page_references_exist(page: Path):
    text, bad = page.read_text(), []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith("http"):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            bad.append(f"link target missing: {target}")
        elif anchor and path.suffix == ".md" and anchor not in set(_anchors(path)):
            bad.append(f"anchor missing: {target}")
    for path in re.findall(r"(?<![\w./])((?:mcore_engine|tests|tools|configs|kernels|examples|docs|\.ci)/"
                           r"[\w./-]*\w/?)", text):
        if not (ROOT / path).exists():
            bad.append(f"path missing: {path}")
    makefile = (ROOT / "Makefile").read_text()
    bad += [f"make target missing: {t}" for t in re.findall(r"\bmake ([a-z][\w-]*)", text)
            if not re.search(rf"^{re.escape(t)}:", makefile, flags=re.M)]
    bad += [f"name does not resolve: {n}" for n in re.findall(r"\b(mcore_engine(?:\.\w+)+)", text)
            if not _resolves(n)]
    for tool, flags in re.findall(r"(tools/\w+\.py)((?: +\[?--[\w-]+(?: [\w.,=/]+)?\]?)+)", text):
        bad += [f"{tool} has no flag {f}" for f in re.findall(r"--[\w-]+", flags) if f not in _help(tool)]
    assert not bad, f"{page.name}: " + "; ".join(bad)
