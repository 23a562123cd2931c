"""References into the docs lead somewhere: every relative link of README.md and docs/*.md names a file
that exists and, with a `#fragment`, a heading of it; every citation of a measurement page by section,
`docs/performance.md, "<title>"`, names a section that one of the two pages has.

docs/performance.md holds the current state and docs/performance-history.md every earlier measurement,
moved there verbatim under the same titles. Code and migrations cite both pages by title; a shipped
migration's text does not change (it is checksummed), so a citation of performance.md may name a section
that now lives in the history, as that page's opening says.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = ("performance.md", "performance-history.md")
_LINK = re.compile(r"\]\(([^()\s]*?)(?:#([^()\s]+))?\)")
_CITATION = re.compile(r'docs/(performance(?:-history)?\.md),? \(?"([^"]+)"')
_WRAP = re.compile(r"\s*\n\s*(?:--|#|\*)?\s*")
# A shipped migration cites a section under a title the page never had; its text cannot change.
_SHIPPED_TITLES = {
    "Contract: the superseded queue index": "The contract step of positions, and a lighter step in Python",
}


def _headings(path: Path) -> list[str]:
    """The headings of a Markdown file, outside its fenced blocks, as written."""
    found: list[str] = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.*)", line)):
            found.append(match.group(1).strip())
    return found


def _anchors(path: Path) -> set[str]:
    """The fragments GitHub gives the headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated one numbered from -1."""
    seen: dict[str, int] = {}
    for heading in _headings(path):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    broken = []
    for path in DOCS:
        for match in _LINK.finditer(path.read_text(encoding="utf-8")):
            target, fragment = match.groups()
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            resolved = (path.parent / target).resolve() if target else path
            if not resolved.exists():
                broken.append(f"{path.name}: {target} does not exist")
            elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
                broken.append(f"{path.name}: {target}#{fragment} names no heading")
    assert not broken, "\n".join(broken)


def test_every_citation_of_a_measurement_page_names_one_of_its_sections() -> None:
    sections = {page: _headings(ROOT / "docs" / page) for page in PAGES}
    tracked = subprocess.run(["git", "ls-files", "src", "tests", "docs", "README.md"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    cited = 0
    missing = []
    for name in tracked:
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        for match in _CITATION.finditer(text):
            page, title = match.group(1), _WRAP.sub(" ", match.group(2))
            if title.startswith("<"):
                continue  # the form itself, as a page explains it
            title = _SHIPPED_TITLES.get(title, title)
            where = sections["performance-history.md"] + (sections["performance.md"] if page == PAGES[0] else [])
            cited += 1
            if not any(title in heading for heading in where):
                missing.append(f'{name}: {page}, "{title}"')
    assert cited > 50, cited
    assert not missing, "\n".join(missing)
