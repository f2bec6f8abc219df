"""The README is a front page and the docs link to what exists: no dated history, no number in the
results without a link to its report, no link to a file that is not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dates belong in CHANGELOG.md and docs/benchmarks.md"
    assert "../shared" not in text and "session" not in text.lower()
    for heading in ("## Install", "## Try it", "## From Python", "## Results", "## Documentation"):
        assert heading in text


def test_every_number_in_the_readmes_results_links_to_its_report() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]  # the header is no result
    assert rows, "the Results section has a table"
    for row in rows:
        for cell in row.strip("|").split("|")[1:]:
            if re.search(r"\d", cell) and cell.strip() not in ("-",):
                assert "](benchmarks/results/" in cell, f"a number without its report: {cell.strip()!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file_of_the_repository(page: Path) -> None:
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
        assert ROOT in path.parents or path == ROOT, f"{page.relative_to(ROOT)} links outside the repository: {target}"
